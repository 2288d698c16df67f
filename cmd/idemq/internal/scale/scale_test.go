package scale

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testdb"
)

// A small run end to end on the real Postgres: load, one cycle with GC
// retiring what the worker added, the table, and the schema dropped after.
func TestRunSmall(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	name := fmt.Sprintf("idemq_scale_test_%08x", rand.Uint32())
	var out, log bytes.Buffer
	res, err := Run(ctx, Options{
		PostgresURL: testdb.URL(), Schema: name, Keys: 2000, Cycles: 1, Cycle: 5 * time.Second,
		Rate: 50, Concurrency: 2, GCBatch: 100, GCVacuum: true, Log: &log,
	}, &out)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, log.String())
	}
	if len(res.Cycles) != 1 {
		t.Fatalf("cycles %d, want 1", len(res.Cycles))
	}
	c := res.Cycles[0]
	if c.Ops[phaseQuiet] == 0 || c.Errors != [phases]int{} {
		t.Fatalf("worker: %d operations, errors %v (first: %v)", c.Ops[phaseQuiet], c.Errors, c.FirstError)
	}
	// GC retired what the worker had added by the middle of the cycle. Keys
	// keep coming due while it runs, so it may read as behind by at most the
	// time its run took (on a loaded machine, tens of milliseconds).
	if c.GCKeys == 0 || c.GCOutbox == 0 || c.Behind > c.GCKeysTook {
		t.Fatalf("gc: %d keys, %d outbox rows, behind %s after a GC run of %s", c.GCKeys, c.GCOutbox, c.Behind, c.GCKeysTook)
	}
	if res.Load.Keys != 2000 || res.Start.Keys.Heap == 0 || c.Sizes.Keys.Heap == 0 {
		t.Fatalf("load %+v, sizes %+v", res.Load, c.Sizes)
	}
	if !strings.Contains(out.String(), "cycle") || !strings.Contains(out.String(), "end:") || !strings.Contains(out.String(), "all cycles:") {
		t.Fatalf("no table:\n%s", out.String())
	}
	// The run's p99 is over every cycle's operations.
	if all := res.Overall(); all.Ops[phaseQuiet] != c.Ops[phaseQuiet] || all.OpsGC != c.OpsGC || all.P99[phaseQuiet] != c.P99[phaseQuiet] {
		t.Fatalf("overall %+v does not add up the one cycle %+v", all, c)
	}
	pool := testdb.Pool(t, 1)
	var left bool
	if err := pool.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)", name).Scan(&left); err != nil || left {
		t.Fatalf("schema left behind: %v, %v", left, err)
	}
}

func TestQuantile(t *testing.T) {
	t.Parallel()
	var d []time.Duration
	for i := 1; i <= 100; i++ {
		d = append(d, time.Duration(i)*time.Millisecond)
	}
	if q := quantile(d, 0.99); q != 99*time.Millisecond {
		t.Fatalf("p99 = %s", q)
	}
	if q := quantile(nil, 0.99); q != 0 {
		t.Fatalf("p99 of nothing = %s", q)
	}
}

func TestScopeOfIsStable(t *testing.T) {
	t.Parallel()
	if scopeOf(7) != scopeOf(7) || scopeOf(7) == scopeOf(8) {
		t.Fatal("scopeOf must give one scope per index")
	}
}

// A run with Reuse goes on with the day a run with Keep left: no load, and
// GC retires from where the first run stopped.
func TestRunGoesOnWithAKeptDay(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	name := fmt.Sprintf("idemq_scale_test_%08x", rand.Uint32())
	pool := testdb.Pool(t, 1)
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+name+" CASCADE") })
	o := Options{
		PostgresURL: testdb.URL(), Schema: name, Keys: 2000, Cycles: 1, Cycle: 5 * time.Second,
		Rate: 50, Concurrency: 2, GCBatch: 100, Keep: true, Reuse: true,
	}
	var out bytes.Buffer
	first, err := Run(ctx, o, &out)
	if err != nil {
		t.Fatalf("first run: %v", err)
	}
	if first.Load.Reused || first.Cycles[0].GCKeys == 0 {
		t.Fatalf("first run: reused %v, GC retired %d", first.Load.Reused, first.Cycles[0].GCKeys)
	}
	second, err := Run(ctx, o, &out)
	if err != nil {
		t.Fatalf("second run: %v", err)
	}
	if !second.Load.Reused || second.Load.Retired == 0 || second.Load.Base != first.Load.Base {
		t.Fatalf("second run took over %+v, want the first run's day with its retired keys", second.Load)
	}
	// The second run's GC found keys of its own to retire: the horizon moved
	// on from where the first left it.
	if c := second.Cycles[0]; c.GCKeys == 0 || c.Errors != [phases]int{} {
		t.Fatalf("second run: GC retired %d, errors %v (first: %v)", c.GCKeys, c.Errors, c.FirstError)
	}
	if !strings.Contains(out.String(), "taken over from an earlier run") {
		t.Fatalf("the table does not say the day was taken over:\n%s", out.String())
	}
}

// GC goes on past the loaded day into the keys the worker added, so that a
// run can turn the whole table over (and show where its indexes settle).
func TestRunTurnsTheTableOver(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	name := fmt.Sprintf("idemq_scale_test_%08x", rand.Uint32())
	var out bytes.Buffer
	res, err := Run(ctx, Options{
		PostgresURL: testdb.URL(), Schema: name, Keys: 1000, Cycles: 3, Cycle: 5 * time.Second,
		Rate: 200, Concurrency: 2, GCBatch: 100,
	}, &out)
	if err != nil {
		t.Fatalf("run: %v", err)
	}
	var gc int64
	for _, c := range res.Cycles {
		gc += c.GCKeys
		// Keys keep coming due while GC runs: the ones due between its last
		// batch and its measure of the lag read as behind by that moment,
		// never by more than the run took. More means GC fell behind.
		if c.Errors != [phases]int{} || c.Behind > c.GCKeysTook {
			t.Fatalf("cycle %d: errors %v (first: %v), behind %s after a GC run of %s", c.N, c.Errors, c.FirstError, c.Behind, c.GCKeysTook)
		}
	}
	if gc <= int64(res.Load.Keys) {
		t.Fatalf("GC retired %d keys in all, want more than the %d of the day:\n%s", gc, res.Load.Keys, out.String())
	}
	// What is left is about one day's worth: the table kept its row count.
	// The run adds three days' worth (4,000 keys in all without GC); on a
	// loaded machine the last cycle's keys may still be due when it ends
	// (2,167 seen once in CI), so the bound is three days, well short of
	// what a GC that does not keep up would leave.
	if res.EndKeys < int64(res.Load.Keys)/2 || res.EndKeys > 3*int64(res.Load.Keys) {
		t.Fatalf("%d keys at the end of a run over a day of %d", res.EndKeys, res.Load.Keys)
	}
}
