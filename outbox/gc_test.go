package outbox_test

import (
	"context"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
)

// A bounded GC run deletes the oldest published rows first and reports, in
// its result and in idemq.gc.behind, how far behind the horizon it stopped.
func TestGCWithBoundedRunReportsBehind(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, 4)
	name := testdb.Schema(t, pool)
	ctx := context.Background()
	if err := schema.Migrate(ctx, pool, name); err != nil {
		t.Fatal(err)
	}
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	ob, err := outbox.New(pool, &outbox.Config{Schema: name, MeterProvider: mp})
	if err != nil {
		t.Fatal(err)
	}
	// 60 messages published one a minute, from 2 hours to 1 hour ago; a
	// pending row; and 5 rows marked in place (as before migration 009, or by
	// an older relay) an hour and a half ago.
	if _, err := pool.Exec(ctx, `INSERT INTO `+name+`.outbox_published (id, message_id, exchange, routing_key, created_at, published_at, attempts, returns)
SELECT j, 'm' || j, 'x', 'k', now() - interval '3 hours', now() - interval '2 hours' + j * interval '1 minute', 1, 0 FROM generate_series(0, 59) AS j`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+name+`.outbox (exchange, routing_key, body, message_id, published_at)
SELECT 'x', 'k', ''::bytea, 'legacy' || j, now() - interval '90 minutes' FROM generate_series(1, 5) AS j
UNION ALL SELECT 'x', 'k', ''::bytea, 'pending', NULL`); err != nil {
		t.Fatal(err)
	}
	res, err := ob.GC(ctx, dedup.GCOptions{Retention: time.Hour, Batch: 10, MaxBatches: 2})
	if err != nil {
		t.Fatal(err)
	}
	// The 20 oldest went; the oldest left was published 1h40m ago: 40 minutes behind.
	if res.Deleted != 20 || res.Batches != 2 || res.Behind < 39*time.Minute || res.Behind > 41*time.Minute {
		t.Fatalf("bounded gc = %+v, want 20 rows in 2 batches, 40m behind", res)
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Gauge[float64]:
				for _, p := range d.DataPoints {
					got[m.Name] = p.Value
				}
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					if v, _ := p.Attributes.Value("idemq.gc.table"); v.AsString() == "outbox" {
						got[m.Name] += float64(p.Value)
					}
				}
			}
		}
	}
	if got["idemq.gc.deleted"] != 20 || got["idemq.gc.batches"] != 2 || got["idemq.gc.behind"] < 39*60 || got["idemq.gc.behind"] > 41*60 {
		t.Fatalf("metrics %v, want 20 deleted, 2 batches, 40m behind", got)
	}
	res, err = ob.GC(ctx, dedup.GCOptions{Retention: time.Hour, Batch: 10, Vacuum: true, Session: testdb.Direct(t)})
	if err != nil {
		t.Fatal(err)
	}
	if res.Deleted != 45 || res.Behind != 0 || res.Vacuumed <= 0 {
		t.Fatalf("gc to the end = %+v, want the 40 records and 5 rows left due, nothing behind, a vacuum", res)
	}
	var left, records int
	if err := pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM "+name+".outbox), (SELECT count(*) FROM "+name+".outbox_published)").Scan(&left, &records); err != nil || left != 1 || records != 0 {
		t.Fatalf("rows left %d, records %d, %v; want the pending row only", left, records, err)
	}
}
