// Package sweep runs retention for the key store and the outbox: bounded
// DELETE statements, oldest rows first, one after the other until a batch
// comes back short, with an optional pause between batches and an optional
// bound on their number, and the metrics of what a run did (idemq.gc.*).
//
// Both tables' GC share it, so that they behave and report alike; the
// tables' own packages (dedup, outbox) own their SQL.
package sweep

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// Defaults of a run, for both tables (dedup.DefaultGCBatchSize,
// outbox.DefaultGCBatchSize, dedup.DefaultGCPause).
const (
	// DefaultBatch is the most rows one statement deletes. Small: each batch
	// commits, and a commit flushes the WAL its deletes wrote (the heap
	// pages' full-page images after a checkpoint); the workers' commits wait
	// behind that flush. At 1,000 rows a batch the workers' p99 rose by
	// 14-61 % while GC deleted; at 200 it did not move (docs/operations.md).
	DefaultBatch = 200
	// DefaultPause is the pause idemq gc takes after each full batch:
	// DefaultBatch rows per DefaultPause caps GC at 4,000 rows a second per
	// table, far above what 10 M keys a day need (116/s).
	DefaultPause = 50 * time.Millisecond
)

// Querier runs the statements: a pool or a connection. A run keeps no
// state in a session between its statements, so that a pool behind a
// transaction pooler (PgBouncer) serves it as well as a connection.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Begin(ctx context.Context) (pgx.Tx, error)
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// DeleteSQL is the statement of a Step: it deletes at most $2 rows of table
// that match where (which may use $1, the retention in microseconds), first
// in the order of orderBy (an index's, so that the scan stops after $2
// rows), and skips rows that others hold locked.
//
// The rows it picked and locked are deleted where they lie (ctid, a Tid
// Scan), not found again through the primary key: for the key table, whose
// keys are random, that join read one random index page per row, into the
// shared buffers the workers live in. A row's ctid cannot change while the
// statement holds its lock; a version newer than the statement's snapshot
// is left for the next run.
func DeleteSQL(table, where, orderBy string) string {
	return `DELETE FROM ` + table + ` WHERE ctid = ANY (ARRAY (
    SELECT ctid FROM ` + table + `
    WHERE ` + where + `
    ORDER BY ` + orderBy + `
    LIMIT $2 FOR UPDATE SKIP LOCKED))`
}

// Step is one kind of row a run deletes.
type Step struct {
	// Kind names the rows in the metrics (attribute idemq.gc.kind):
	// completed, abandoned, published, parked.
	Kind string
	// SQL deletes at most $2 rows due under a retention of $1 microseconds,
	// oldest first: a DeleteSQL statement.
	SQL string
}

// Options bound and pace a run.
type Options struct {
	// Retention is the age beyond which rows are due. Required.
	Retention time.Duration
	// Batch is the most rows one statement deletes. Required.
	Batch int
	// Pause is how long the run waits after each full batch, so that a
	// large backlog is worked off at a bounded pace. 0: no pause.
	Pause time.Duration
	// MaxBatches ends the run after that many statements, due rows left or
	// not. 0: no bound.
	MaxBatches int
	// Vacuum, when set, is the (quoted) table, or the comma-separated
	// tables, a run that deleted rows vacuums after its deletes, throttled
	// as autovacuum is by default (vacuum_cost_delay 2ms), so that the space
	// of the deleted rows is reused at once. It needs the table's owner.
	Vacuum string
	// Session is where the VACUUM connects: a connection of its own, made
	// for it and closed after, whose throttle is a startup parameter. A
	// transaction pooler refuses that parameter (PgBouncer: unsupported
	// startup parameter), where a SET could reach another backend than the
	// VACUUM: through one, Session must reach Postgres directly. Required
	// with Vacuum.
	Session *pgx.ConnConfig
}

// Result is what a run did.
type Result struct {
	// Deleted counts the rows deleted, per step, in the order of the steps.
	Deleted []int64
	// Batches counts the DELETE statements that ran.
	Batches int
	// Vacuumed is how long the VACUUM after the deletes took (0: none ran).
	Vacuumed time.Duration
	// Behind is how far the oldest row still due lies past the retention
	// horizon at the end of the run: 0 when the run left nothing due.
	Behind time.Duration
}

// Metrics are the GC instruments of one table.
type Metrics struct {
	deleted  metric.Int64Counter
	batches  metric.Int64Counter
	behind   metric.Float64Gauge
	duration metric.Float64Histogram
	attrs    []attribute.KeyValue
}

// Metric names, as docs/observability.md lists them.
const (
	MetricDeleted  = "idemq.gc.deleted"
	MetricBatches  = "idemq.gc.batches"
	MetricBehind   = "idemq.gc.behind"
	MetricDuration = "idemq.gc.duration"
)

// NewMetrics makes the instruments from mp (nil: the global provider), on
// the meter named scope; every measurement carries idemq.schema and
// idemq.gc.table.
func NewMetrics(mp metric.MeterProvider, scope, schema, table string) (*Metrics, error) {
	m := cmp.Or[metric.MeterProvider](mp, otel.GetMeterProvider()).Meter(scope)
	out := &Metrics{attrs: []attribute.KeyValue{attribute.String("idemq.schema", schema), attribute.String("idemq.gc.table", table)}}
	var err error
	if out.deleted, err = m.Int64Counter(MetricDeleted,
		metric.WithDescription("Rows deleted by retention, by table and kind."), metric.WithUnit("{row}")); err != nil {
		return nil, err
	}
	if out.batches, err = m.Int64Counter(MetricBatches,
		metric.WithDescription("DELETE statements run by retention."), metric.WithUnit("{batch}")); err != nil {
		return nil, err
	}
	if out.behind, err = m.Float64Gauge(MetricBehind,
		metric.WithDescription("How far the oldest row due for deletion lies past the retention horizon, at the end of each GC run (0 while GC keeps up)."),
		metric.WithUnit("s")); err != nil {
		return nil, err
	}
	if out.duration, err = m.Float64Histogram(MetricDuration,
		metric.WithDescription("Wall time of one GC run."), metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600)); err != nil {
		return nil, err
	}
	return out, nil
}

// Run deletes the due rows of each step in turn, a batch at a time, until a
// batch comes back short, MaxBatches statements ran, or ctx ends; then it
// measures how far behind the horizon the table is with behindSQL (one row,
// one column: microseconds, $1 = the retention in microseconds) and records
// the metrics. It returns what it deleted also when it fails.
func Run(ctx context.Context, q Querier, m *Metrics, steps []Step, behindSQL string, o Options) (Result, error) {
	res := Result{Deleted: make([]int64, len(steps))}
	if o.Retention <= 0 || o.Batch < 1 {
		return res, fmt.Errorf("retention %s and batch %d must be positive", o.Retention, o.Batch)
	}
	if o.Vacuum != "" && o.Session == nil {
		return res, errors.New("vacuum needs Options.Session")
	}
	start := time.Now()
	err := run(ctx, q, m, steps, o, walCompression(ctx, q), &res)
	// Measure also after a failure or a deadline: a run cut short is what
	// the behind gauge is there to show. Measured before the VACUUM, which
	// deletes nothing while the horizon moves on.
	mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	var us int64
	if berr := q.QueryRow(mctx, behindSQL, o.Retention.Microseconds()).Scan(&us); berr != nil {
		err = errors.Join(err, fmt.Errorf("measure behind: %w", berr))
	} else {
		res.Behind = time.Duration(max(us, 0)) * time.Microsecond
		m.behind.Record(mctx, res.Behind.Seconds(), metric.WithAttributes(m.attrs...))
	}
	if err == nil && o.Vacuum != "" && sum(res.Deleted) > 0 {
		err = vacuum(ctx, o.Session, o.Vacuum, &res)
	}
	m.duration.Record(mctx, time.Since(start).Seconds(), metric.WithAttributes(m.attrs...))
	return res, err
}

func run(ctx context.Context, q Querier, m *Metrics, steps []Step, o Options, wal string, res *Result) error {
	attrs := metric.WithAttributes(m.attrs...)
	for i, step := range steps {
		kind := metric.WithAttributes(append(m.attrs[:len(m.attrs):len(m.attrs)], attribute.String("idemq.gc.kind", step.Kind))...)
		for {
			if o.MaxBatches > 0 && res.Batches >= o.MaxBatches {
				return nil
			}
			tag, err := deleteBatch(ctx, q, wal, step.SQL, o.Retention.Microseconds(), o.Batch)
			if err != nil {
				return fmt.Errorf("delete %s: %w", step.Kind, err)
			}
			res.Batches++
			res.Deleted[i] += tag.RowsAffected()
			m.batches.Add(ctx, 1, attrs)
			m.deleted.Add(ctx, tag.RowsAffected(), kind)
			if tag.RowsAffected() < int64(o.Batch) {
				break
			}
			if err := pause(ctx, o.Pause); err != nil {
				return err
			}
		}
	}
	return nil
}

func sum(ns []int64) int64 {
	var t int64
	for _, n := range ns {
		t += n
	}
	return t
}

// vacuum runs VACUUM on table, with its index pass, throttled like
// autovacuum, on a connection of its own made from session (see
// Options.Session).
func vacuum(ctx context.Context, session *pgx.ConnConfig, table string, res *Result) error {
	start := time.Now()
	cfg := session.Copy()
	if cfg.RuntimeParams == nil {
		cfg.RuntimeParams = map[string]string{}
	}
	cfg.RuntimeParams["vacuum_cost_delay"] = "2"
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return fmt.Errorf("vacuum %s: connect (the VACUUM's throttle is a startup parameter, which a transaction pooler refuses: through one, give GC a direct connection, GCOptions.Session or idemq --postgres-direct-url): %w", table, err)
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	// INDEX_CLEANUP ON: when few pages hold dead rows (GC's deletes sit
	// together), VACUUM would skip the index pass, and then it cannot mark
	// those pages' space free: the table would grow by up to 2 % of its pages
	// before a pass runs. A GC that vacuums wants the space back now.
	if _, err := conn.Exec(ctx, "VACUUM (INDEX_CLEANUP ON) "+table); err != nil {
		return fmt.Errorf("vacuum %s: %w", table, err)
	}
	res.Vacuumed = time.Since(start)
	return nil
}

// walCompression is how the run's deletes compress the full-page images of
// the WAL they write (wal_compression: lz4 where the server has it, else
// on), or "" where the role may not set it: GC's deletes and VACUUM dirty
// many pages once each, and half of their WAL is then saved, which the
// workers' commits would otherwise wait behind. Only a superuser, or a role
// granted SET on the parameter (Postgres 15: GRANT SET ON PARAMETER
// wal_compression TO role), may. It is tried in a transaction that rolls
// back.
func walCompression(ctx context.Context, q Querier) string {
	for _, method := range []string{"lz4", "on"} {
		tx, err := q.Begin(ctx)
		if err != nil {
			return ""
		}
		_, err = tx.Exec(ctx, "SELECT set_config('wal_compression', $1, true)", method)
		_ = tx.Rollback(ctx)
		if err == nil {
			return method
		}
	}
	return ""
}

// deleteBatch runs one delete, with wal_compression set to wal for its
// transaction alone (set_config's is_local, in the batch's one implicit
// transaction): no session keeps the setting, through a pooler or not.
func deleteBatch(ctx context.Context, q Querier, wal, sql string, args ...any) (pgconn.CommandTag, error) {
	if wal == "" {
		return q.Exec(ctx, sql, args...)
	}
	b := &pgx.Batch{}
	b.Queue("SELECT set_config('wal_compression', $1, true)", wal)
	b.Queue(sql, args...)
	br := q.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		_ = br.Close()
		return pgconn.CommandTag{}, fmt.Errorf("set wal_compression: %w", err)
	}
	tag, err := br.Exec()
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return tag, err
}

func pause(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
