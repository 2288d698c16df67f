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
	if c.Ops[phaseQuiet] == 0 || c.Errors[phaseQuiet]+c.Errors[phaseGC] != 0 {
		t.Fatalf("worker: %d operations, %d+%d errors", c.Ops[phaseQuiet], c.Errors[phaseQuiet], c.Errors[phaseGC])
	}
	// GC retired what the worker had added by the middle of the cycle.
	if c.GCKeys == 0 || c.GCOutbox == 0 || c.Behind != 0 {
		t.Fatalf("gc: %d keys, %d outbox rows, behind %s", c.GCKeys, c.GCOutbox, c.Behind)
	}
	if res.Load.Keys != 2000 || res.Start.Keys.Heap == 0 || c.Sizes.Keys.Heap == 0 {
		t.Fatalf("load %+v, sizes %+v", res.Load, c.Sizes)
	}
	if !strings.Contains(out.String(), "cycle") || !strings.Contains(out.String(), "end:") {
		t.Fatalf("no table:\n%s", out.String())
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
