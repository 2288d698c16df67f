package outbox

import (
	"cmp"
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/dedup"
)

// DefaultGCBatchSize bounds the rows one GC statement deletes.
const DefaultGCBatchSize = dedup.DefaultGCBatchSize

// GC deletes published rows of the outbox in schema ("" =
// dedup.DefaultSchema) whose publication is older than retention, in
// statements of at most batch rows (0 = DefaultGCBatchSize), each short, so
// no long lock is held. It returns how many rows it deleted. Parked rows are
// never deleted here: they wait for an operator (see Unpark and GCParked).
func GC(ctx context.Context, pool *pgxpool.Pool, schema string, retention time.Duration, batch int) (int64, error) {
	return gc(ctx, pool, schema, "published_at", retention, batch)
}

// GCParked deletes parked rows parked longer ago than retention, in batches
// like GC. It drops messages that were never published: run it only on
// purpose.
func GCParked(ctx context.Context, pool *pgxpool.Pool, schema string, retention time.Duration, batch int) (int64, error) {
	return gc(ctx, pool, schema, "parked_at", retention, batch)
}

func gc(ctx context.Context, pool *pgxpool.Pool, schema, column string, retention time.Duration, batch int) (int64, error) {
	schema = cmp.Or(schema, dedup.DefaultSchema)
	batch = cmp.Or(batch, DefaultGCBatchSize)
	if err := validateSchema(schema); err != nil {
		return 0, fmt.Errorf("outbox: gc: %w", err)
	}
	if retention < 0 || batch < 1 {
		return 0, fmt.Errorf("outbox: gc: retention %s and batch %d must not be negative", retention, batch)
	}
	t := pgx.Identifier{schema, "outbox"}.Sanitize()
	// SKIP LOCKED keeps GC out of the relays' way.
	sql := `DELETE FROM ` + t + ` WHERE id IN (
    SELECT id FROM ` + t + `
    WHERE ` + column + ` < now() - $1::bigint * interval '1 microsecond'
    LIMIT $2 FOR UPDATE SKIP LOCKED)`
	var total int64
	for {
		tag, err := pool.Exec(ctx, sql, retention.Microseconds(), batch)
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
func Unpark(ctx context.Context, pool *pgxpool.Pool, schema string, ids ...int64) (int64, error) {
	schema = cmp.Or(schema, dedup.DefaultSchema)
	if err := validateSchema(schema); err != nil {
		return 0, fmt.Errorf("outbox: unpark: %w", err)
	}
	tag, err := pool.Exec(ctx, `UPDATE `+pgx.Identifier{schema, "outbox"}.Sanitize()+`
SET parked_at = NULL, parked_reason = NULL, returns = 0, available_at = now()
WHERE id = ANY($1) AND parked_at IS NOT NULL`, ids)
	if err != nil {
		return 0, fmt.Errorf("outbox: unpark: %w", err)
	}
	if tag.RowsAffected() > 0 {
		// Wake the relays now rather than at their next poll.
		if _, err := pool.Exec(ctx, "SELECT pg_notify($1, '')", ChannelName(schema)); err != nil {
			return tag.RowsAffected(), fmt.Errorf("outbox: unpark: notify: %w", err)
		}
	}
	return tag.RowsAffected(), nil
}
