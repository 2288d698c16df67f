package outbox

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/sweep"
)

// DefaultGCBatchSize bounds the rows one GC statement deletes: the same as
// the key table's (dedup.DefaultGCBatchSize).
const DefaultGCBatchSize = sweep.DefaultBatch

// GCResult is what one GC run did.
type GCResult struct {
	// Deleted counts the rows deleted.
	Deleted int64
	// Batches counts the DELETE statements the run made.
	Batches int
	// Vacuumed is how long the VACUUM after the deletes took (dedup.GCOptions.Vacuum).
	Vacuumed time.Duration
	// Behind is how far the oldest row still due lies past the retention
	// horizon when the run ended: 0 when the run left nothing due.
	Behind time.Duration
}

// GC deletes published rows whose publication is older than the
// retention (o.Retention, 0 = dedup.DefaultRetention), in statements of at
// most o.Batch rows (0 = DefaultGCBatchSize), oldest first, each short, so
// no long lock is held. Parked rows are never deleted here: they wait for
// an operator (see Unpark and GCParked). With o.Vacuum it vacuums the
// outbox's tables (the record of published messages, and the outbox table,
// where the relays' moves leave dead rows too). It records the metrics
// idemq.gc.* (rows deleted, batches, time behind the horizon, run time) on
// the outbox's MeterProvider, with idemq.gc.table = outbox.
func (o *Outbox) GC(ctx context.Context, opts dedup.GCOptions) (GCResult, error) {
	// The record of published messages (migration 009), then the rows
	// published in place before it, which the outbox table still holds.
	return o.gc(ctx, "published", "published_at", opts, o.published, o.table)
}

// GCParked deletes rows parked longer ago than the retention, bounded and
// paced as GC. It drops messages that were never published: run it only on
// purpose.
func (o *Outbox) GCParked(ctx context.Context, opts dedup.GCOptions) (GCResult, error) {
	return o.gc(ctx, "parked", "parked_at", opts, o.table)
}

// gc deletes the rows of kind due by column from each table in turn.
func (o *Outbox) gc(ctx context.Context, kind, column string, opts dedup.GCOptions, tables ...string) (GCResult, error) {
	opts.Batch = cmp.Or(opts.Batch, DefaultGCBatchSize)
	opts.Retention = cmp.Or(opts.Retention, dedup.DefaultRetention)
	if opts.Retention < 0 || opts.Batch < 1 {
		return GCResult{}, fmt.Errorf("outbox: gc: retention %s and batch %d must not be negative", opts.Retention, opts.Batch)
	}
	retention := opts.Retention
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
	sw := sweep.Options{Retention: retention, Batch: opts.Batch, Pause: opts.Pause, MaxBatches: opts.MaxBatches,
		Session: cmp.Or(opts.Session, o.pool.Config().ConnConfig)}
	if opts.Vacuum {
		// The relays' moves leave dead rows in the outbox table too.
		vacuum := append(slices.Clone(tables), o.table)
		slices.Sort(vacuum)
		sw.Vacuum = strings.Join(slices.Compact(vacuum), ", ")
	}
	r, err := sweep.Run(ctx, o.pool, o.gcMetrics, steps, behind, sw)
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
