package dedup_test

import (
	"context"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/testdb"
)

// gcMetrics reads the GC instruments of the keys table: the behind gauge in
// seconds, and the deleted and batches counters.
func gcMetrics(t *testing.T, reader *sdkmetric.ManualReader) (behind float64, deleted, batches int64) {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	behind = -1
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Gauge[float64]:
				if m.Name == "idemq.gc.behind" {
					for _, p := range d.DataPoints {
						if v, _ := p.Attributes.Value("idemq.gc.table"); v.AsString() == "keys" {
							behind = p.Value
						}
					}
				}
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					switch m.Name {
					case "idemq.gc.deleted":
						deleted += p.Value
					case "idemq.gc.batches":
						batches += p.Value
					}
				}
			}
		}
	}
	return behind, deleted, batches
}

// A GC that deletes less than falls due run after run shows it in
// idemq.gc.behind long before the table has grown: here each run may delete
// 5 keys while 10 more fall due, and the gauge rises by 5 minutes a run.
func TestGCBehindRisesWhenGCFallsBehind(t *testing.T) {
	t.Parallel()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	store, pool := newStore(t, 4, &dedup.Config{MeterProvider: mp})
	ctx := context.Background()
	table := store.Config().Schema + ".keys"

	// One completed key a minute over the two hours before base.
	var base time.Time
	if err := pool.QueryRow(ctx, `INSERT INTO `+table+` (consumer, key, state, fingerprint, outcome, created_at, completed_at)
SELECT 'payments', 'k' || j, 'completed', '\x00', 'ok', t, t
FROM (SELECT j, now() - interval '2 hours' + j * interval '1 minute' AS t FROM generate_series(0, 119) AS j) AS s
RETURNING now()`).Scan(&base); err != nil {
		t.Fatal(err)
	}
	// Run r happens "r × 10 minutes later": the horizon is moved forward by
	// shortening the retention, so that 10 more keys fall due each run.
	retention := func(r int) time.Duration {
		return time.Since(base) + 2*time.Hour - time.Duration(r)*10*time.Minute + 30*time.Second
	}
	last := 0.0
	for r := 1; r <= 4; r++ {
		res, err := store.GC(ctx, dedup.GCOptions{Retention: retention(r), Batch: 5, MaxBatches: 1})
		if err != nil {
			t.Fatal(err)
		}
		if res.Completed != 5 || res.Batches != 1 {
			t.Fatalf("run %d: %+v, want 5 keys in 1 batch", r, res)
		}
		// Oldest first: key 5r is the oldest left, (10r - 0.5) - 5r minutes
		// behind the horizon.
		want := time.Duration(5*r)*time.Minute - 30*time.Second
		if d := res.Behind - want; d < -5*time.Second || d > 5*time.Second {
			t.Fatalf("run %d: behind %s, want about %s", r, res.Behind, want)
		}
		behind, deleted, batches := gcMetrics(t, reader)
		if behind <= last || deleted != int64(5*r) || batches != int64(r) {
			t.Fatalf("run %d: metrics behind %.0fs (last %.0fs), deleted %d, batches %d; want a rising gauge, %d, %d",
				r, behind, last, deleted, batches, 5*r, r)
		}
		if d := behind - res.Behind.Seconds(); d < -1 || d > 1 {
			t.Fatalf("run %d: gauge %.1fs, result %s", r, behind, res.Behind)
		}
		last = behind
	}
	// A run without bound catches up: nothing due is left.
	res, err := store.GC(ctx, dedup.GCOptions{Retention: retention(4), Batch: 5})
	if err != nil {
		t.Fatal(err)
	}
	if res.Completed != 20 || res.Behind != 0 {
		t.Fatalf("unbounded run: %+v, want the 20 due keys deleted and nothing behind", res)
	}
	if behind, deleted, _ := gcMetrics(t, reader); behind != 0 || deleted != 40 {
		t.Fatalf("after catching up: behind %.0fs, deleted %d; want 0 and 40", behind, deleted)
	}
}

// GC with Vacuum vacuums the key table after deleting, so that the space is
// reused without waiting for autovacuum.
func TestGCVacuum(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 4, nil)
	ctx := context.Background()
	schema := store.Config().Schema
	if _, err := pool.Exec(ctx, `INSERT INTO `+schema+`.keys (consumer, key, state, fingerprint, outcome, created_at, completed_at)
SELECT 'payments', 'k' || j, 'completed', '\x00', 'ok', now() - interval '2 days', now() - interval '2 days' FROM generate_series(1, 50) AS j`); err != nil {
		t.Fatal(err)
	}
	res, err := store.GC(ctx, dedup.GCOptions{Retention: 24 * time.Hour, Vacuum: true, Session: testdb.Direct(t)})
	if err != nil {
		t.Fatal(err)
	}
	if res.Completed != 50 || res.Vacuumed <= 0 {
		t.Fatalf("gc = %+v, want 50 deleted and a vacuum", res)
	}
}

// The GC lease is per schema: a run holding one schema's lease makes another
// GC of that schema skip, never the GC of another schema in the database; a
// lease that expired (its run died) is taken over, and a run gives its
// lease back when it ends. It holds through a transaction pooler: no
// session keeps it.
func TestGCLeaseIsPerSchema(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 4, nil)
	other, _ := newStore(t, 4, nil)
	ctx := context.Background()
	runs := store.Config().Schema + ".gc_runs"
	// The lease another instance's run holds.
	if _, err := pool.Exec(ctx, "INSERT INTO "+runs+" VALUES ('keys', 'another', now() + interval '1 minute')"); err != nil {
		t.Fatal(err)
	}
	if res, err := store.GC(ctx, dedup.GCOptions{Retention: time.Hour}); err != nil || !res.Skipped {
		t.Fatalf("gc of the held schema = %+v, %v; want skipped", res, err)
	}
	if res, err := other.GC(ctx, dedup.GCOptions{Retention: time.Hour}); err != nil || res.Skipped {
		t.Fatalf("gc of another schema = %+v, %v; want it to run", res, err)
	}
	// That run died: its lease expired.
	if _, err := pool.Exec(ctx, "UPDATE "+runs+" SET until = now() - interval '1 second'"); err != nil {
		t.Fatal(err)
	}
	if res, err := store.GC(ctx, dedup.GCOptions{Retention: time.Hour}); err != nil || res.Skipped {
		t.Fatalf("gc after the lease expired = %+v, %v; want it to run", res, err)
	}
	var left int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+runs).Scan(&left); err != nil || left != 0 {
		t.Fatalf("%d leases left after the run (%v), want it given back", left, err)
	}
}
