package outbox

import (
	"cmp"
	"context"
	"fmt"
	"time"
)

// DefaultGCBatchSize bounds the rows one GC statement deletes.
const DefaultGCBatchSize = 1000

// GC deletes published rows whose publication is older than retention, in
// statements of at most batch rows (0 = DefaultGCBatchSize), each short, so
// no long lock is held. It returns how many rows it deleted. Parked rows are
// never deleted here: they wait for an operator (see Unpark and GCParked).
func (o *Outbox) GC(ctx context.Context, retention time.Duration, batch int) (int64, error) {
	return o.gc(ctx, "published_at", retention, batch)
}

// GCParked deletes parked rows parked longer ago than retention, in batches
// like GC. It drops messages that were never published: run it only on
// purpose.
func (o *Outbox) GCParked(ctx context.Context, retention time.Duration, batch int) (int64, error) {
	return o.gc(ctx, "parked_at", retention, batch)
}

func (o *Outbox) gc(ctx context.Context, column string, retention time.Duration, batch int) (int64, error) {
	batch = cmp.Or(batch, DefaultGCBatchSize)
	if retention < 0 || batch < 1 {
		return 0, fmt.Errorf("outbox: gc: retention %s and batch %d must not be negative", retention, batch)
	}
	// SKIP LOCKED keeps GC out of the relays' way.
	sql := `DELETE FROM ` + o.table + ` WHERE id IN (
    SELECT id FROM ` + o.table + `
    WHERE ` + column + ` < now() - $1::bigint * interval '1 microsecond'
    LIMIT $2 FOR UPDATE SKIP LOCKED)`
	var total int64
	for {
		tag, err := o.pool.Exec(ctx, sql, retention.Microseconds(), batch)
		if err != nil {
			return total, fmt.Errorf("outbox: gc: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batch) {
			return total, nil
		}
	}
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
