package dedup

import (
	"cmp"
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/internal/sweep"
)

// GCResult counts what one GC run deleted.
type GCResult struct {
	// Completed is the number of completed keys older than the retention.
	Completed int64
	// Abandoned is the number of in-progress keys whose lease expired more
	// than the retention ago (workers that died and were never redelivered).
	Abandoned int64
	// Batches counts the DELETE statements the run made.
	Batches int
	// Vacuumed is how long the VACUUM after the deletes took (GCOptions.Vacuum).
	Vacuumed time.Duration
	// Behind is how far the oldest key still due lies past the retention
	// horizon when the run ended (by its creation time): 0 when the run left
	// nothing due. It grows run after run when GC does not keep up.
	Behind time.Duration
	// Skipped reports that another instance's run held the schema's GC
	// lease, so nothing ran.
	Skipped bool
}

// GCOptions bound and pace one GC run, of the key table (Store.GC) or of
// the outbox (outbox.Outbox.GC, GCParked): one type for both tables of a
// schema. The zero value runs with the defaults until nothing is due.
type GCOptions struct {
	// Retention is the age beyond which rows are deleted: completed keys
	// and leases abandoned that long ago, published (or parked) outbox
	// rows. 0: the store's Retention for keys, DefaultRetention for the
	// outbox.
	Retention time.Duration
	// Batch is the most rows one DELETE statement removes. 0: the store's
	// GCBatchSize for keys, DefaultGCBatchSize for the outbox.
	Batch int
	// Pause is how long the run waits after each full batch: a backlog is
	// then worked off at most Batch rows per Pause, leaving the database
	// to the workers in between. 0: no pause.
	Pause time.Duration
	// MaxBatches ends the run after that many DELETE statements, rows left
	// due or not (the result's Behind then says how far behind). 0: no
	// bound.
	MaxBatches int
	// Vacuum runs VACUUM on the table after a run that deleted rows,
	// throttled as autovacuum is, so that their space is reused at once
	// rather than when autovacuum comes by (never, where it is off). It
	// needs the table's owner (the role that migrated the schema), and a
	// connection of its own (Session).
	Vacuum bool
	// Session is where the VACUUM connects, on a connection of its own made
	// for it, whose throttle is a startup parameter: nil, the pool's own
	// connection config. Where the pool goes through a transaction pooler
	// (PgBouncer's transaction mode), which refuses that parameter, it must
	// reach Postgres directly (docs/operations.md, "PgBouncer").
	Session *pgx.ConnConfig
}

// GC deletes completed keys older than the retention and leases abandoned
// for longer than the retention, oldest first, in batches, each its own
// short statement, so that no long lock is held; o bounds and paces the
// run. Only one instance works on a schema at a time (the lease of the
// schema's gc_runs row, renewed while the run lasts); the others return
// Skipped. No statement of a run depends on a session: the store's pool may
// go through a transaction pooler. It records the metrics idemq.gc.* (rows
// deleted, batches, time behind the horizon, run time) on the store's
// MeterProvider, with idemq.gc.table = keys.
func (s *Store) GC(ctx context.Context, o GCOptions) (GCResult, error) {
	retention := s.cfg.Retention
	if o.Retention > 0 {
		retention = o.Retention
	}
	var res GCResult
	ctx, release, held, err := s.holdGC(ctx)
	if err != nil {
		return res, interpretError("gc", err)
	}
	if !held {
		res.Skipped = true
		return res, nil
	}
	defer release()
	r, err := sweep.Run(ctx, s.pool, s.gcMetrics, []sweep.Step{
		{Kind: "completed", SQL: s.sql.gcCompleted},
		{Kind: "abandoned", SQL: s.sql.gcAbandoned},
	}, s.sql.gcBehind, sweep.Options{
		Retention:  retention,
		Batch:      cmp.Or(max(o.Batch, 0), s.cfg.GCBatchSize),
		Pause:      o.Pause,
		MaxBatches: o.MaxBatches,
		Vacuum:     vacuumTable(o.Vacuum, s.sql.table),
		Session:    cmp.Or(o.Session, s.pool.Config().ConnConfig),
	})
	res.Completed, res.Abandoned, res.Batches, res.Behind, res.Vacuumed = r.Deleted[0], r.Deleted[1], r.Batches, r.Behind, r.Vacuumed
	if err != nil {
		return res, interpretError("gc", err)
	}
	return res, nil
}

// vacuumTable is table when on, else "" (no VACUUM).
func vacuumTable(on bool, table string) string {
	if on {
		return table
	}
	return ""
}
