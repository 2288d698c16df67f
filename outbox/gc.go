package outbox

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/idemq/idemq/internal/sweep"
)

// DefaultGCBatchSize bounds the rows one GC statement deletes: the same as
// the key table's (dedup.DefaultGCBatchSize).
const DefaultGCBatchSize = sweep.DefaultBatch

// GCOptions bound and pace one GC run.
type GCOptions struct {
	// Retention is the age beyond which published (or, for GCParked,
	// parked) rows are deleted. Required.
	Retention time.Duration
	// Batch is the most rows one statement deletes (0 = DefaultGCBatchSize).
	Batch int
	// Pause is how long the run waits after each full batch. 0: no pause.
	Pause time.Duration
	// MaxBatches ends the run after that many statements, rows left due or
	// not. 0: no bound.
	MaxBatches int
	// Vacuum runs VACUUM on the outbox's tables after a run that deleted
	// rows (the record of published messages, and the outbox table, where
	// the relays' moves leave dead rows too), throttled as autovacuum is, so
	// that their space is reused at once. It needs the tables' owner (the
	// role that migrated the schema).
	Vacuum bool
}

// GCResult is what one GC run did.
type GCResult struct {
	// Deleted counts the rows deleted.
	Deleted int64
	// Batches counts the DELETE statements the run made.
	Batches int
	// Vacuumed is how long the VACUUM after the deletes took (GCOptions.Vacuum).
	Vacuumed time.Duration
	// Behind is how far the oldest row still due lies past the retention
	// horizon when the run ended: 0 when the run left nothing due.
	Behind time.Duration
}

// GC deletes published rows whose publication is older than retention, in
// statements of at most batch rows (0 = DefaultGCBatchSize), oldest first,
// each short, so no long lock is held. It returns how many rows it deleted.
// Parked rows are never deleted here: they wait for an operator (see Unpark
// and GCParked). See GCWith.
func (o *Outbox) GC(ctx context.Context, retention time.Duration, batch int) (int64, error) {
	r, err := o.GCWith(ctx, GCOptions{Retention: retention, Batch: batch})
	return r.Deleted, err
}

// GCWith is GC bounded and paced by opts. It records the metrics idemq.gc.*
// (rows deleted, batches, time behind the horizon, run time) on the
// outbox's MeterProvider, with idemq.gc.table = outbox.
func (o *Outbox) GCWith(ctx context.Context, opts GCOptions) (GCResult, error) {
	// The record of published messages (migration 009), then the rows
	// published in place before it, which the outbox table still holds.
	return o.gc(ctx, "published", "published_at", opts, o.published, o.table)
}

// GCParked deletes parked rows parked longer ago than retention, in batches
// like GC. It drops messages that were never published: run it only on
// purpose.
func (o *Outbox) GCParked(ctx context.Context, retention time.Duration, batch int) (int64, error) {
	r, err := o.gc(ctx, "parked", "parked_at", GCOptions{Retention: retention, Batch: batch}, o.table)
	return r.Deleted, err
}

// gc deletes the rows of kind due by column from each table in turn.
func (o *Outbox) gc(ctx context.Context, kind, column string, opts GCOptions, tables ...string) (GCResult, error) {
	opts.Batch = cmp.Or(opts.Batch, DefaultGCBatchSize)
	if opts.Retention < 0 || opts.Batch < 1 {
		return GCResult{}, fmt.Errorf("outbox: gc: retention %s and batch %d must not be negative", opts.Retention, opts.Batch)
	}
	// A zero retention deletes everything due now; sweep wants it positive.
	retention := max(opts.Retention, time.Microsecond)
	horizon := column + ` < now() - $1::bigint * interval '1 microsecond'`
	// Oldest first through the column's index; SKIP LOCKED keeps GC out of
	// the relays' way. Behind is the oldest due row of any table.
	steps := make([]sweep.Step, len(tables))
	oldest := make([]string, len(tables))
	for i, t := range tables {
		steps[i] = sweep.Step{Kind: kind, SQL: sweep.DeleteSQL(t, horizon, column)}
		oldest[i] = `(SELECT min(` + column + `) FROM ` + t + ` WHERE ` + horizon + `)`
	}
	behind := `SELECT coalesce((extract(epoch FROM (now() - $1::bigint * interval '1 microsecond') - least(` +
		strings.Join(oldest, ", ") + `)) * 1e6)::bigint, 0)`
	// One connection for the run: VACUUM's throttle is a session setting.
	conn, err := o.pool.Acquire(ctx)
	if err != nil {
		return GCResult{}, fmt.Errorf("outbox: gc: acquire connection: %w", err)
	}
	defer conn.Release()
	sw := sweep.Options{Retention: retention, Batch: opts.Batch, Pause: opts.Pause, MaxBatches: opts.MaxBatches}
	if opts.Vacuum {
		// The relays' moves leave dead rows in the outbox table too.
		vacuum := append(slices.Clone(tables), o.table)
		slices.Sort(vacuum)
		sw.Vacuum = strings.Join(slices.Compact(vacuum), ", ")
	}
	r, err := sweep.Run(ctx, conn, o.gcMetrics, steps, behind, sw)
	res := GCResult{Batches: r.Batches, Behind: r.Behind, Vacuumed: r.Vacuumed}
	for _, n := range r.Deleted {
		res.Deleted += n
	}
	if err != nil {
		return res, fmt.Errorf("outbox: gc: %w", err)
	}
	return res, nil
}

// Unpark makes parked rows pending again, with their return count reset,
// once the operator has fixed their routing. It returns how many rows it
// changed.
func (o *Outbox) Unpark(ctx context.Context, ids ...int64) (int64, error) {
	tag, err := o.pool.Exec(ctx, `UPDATE `+o.table+`
SET parked_at = NULL, parked_reason = NULL, returns = 0, available_at = now()
WHERE id = ANY($1) AND parked_at IS NOT NULL`, ids)
	if err != nil {
		return 0, fmt.Errorf("outbox: unpark: %w", err)
	}
	if tag.RowsAffected() > 0 {
		// Wake the relays now rather than at their next poll.
		if _, err := o.pool.Exec(ctx, "SELECT pg_notify($1, '')", ChannelName(o.cfg.Schema)); err != nil {
			return tag.RowsAffected(), fmt.Errorf("outbox: unpark: notify: %w", err)
		}
	}
	return tag.RowsAffected(), nil
}
