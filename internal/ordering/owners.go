package ordering

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Owner is the worker last seen as the active consumer of one partition
// (the table of migration 011_partition_owners).
type Owner struct {
	Consumer, Queue string
	// Owner names the worker: its connection name, host and process.
	Owner string
	// Since is when Owner took the partition (its first record in a row);
	// SeenAt when it last recorded that it consumes it.
	Since, SeenAt time.Time
}

// MarkOwner records that owner is the active consumer of queue for
// consumer now: a new owner starts a new Since.
func MarkOwner(ctx context.Context, db Querier, schema, consumer, queue, owner string) error {
	_, err := db.Exec(ctx, `INSERT INTO `+schema+`.partition_owners AS p (consumer, queue, owner) VALUES ($1, $2, $3)
ON CONFLICT (consumer, queue) DO UPDATE SET
	since = CASE WHEN p.owner = excluded.owner THEN p.since ELSE now() END,
	owner = excluded.owner,
	seen_at = now()`, consumer, queue, owner)
	if err != nil {
		return fmt.Errorf("record partition owner: %w", err)
	}
	return nil
}

// Owners lists the partitions' owners of consumer ("" every consumer), by
// consumer and queue.
func Owners(ctx context.Context, db Querier, schema, consumer string) ([]Owner, error) {
	rows, err := db.Query(ctx, `SELECT consumer, queue, owner, since, seen_at FROM `+schema+`.partition_owners
WHERE $1 = '' OR consumer = $1 ORDER BY consumer, queue`, consumer)
	if err != nil {
		return nil, fmt.Errorf("list partition owners: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Owner])
	if err != nil {
		return nil, fmt.Errorf("list partition owners: %w", err)
	}
	return out, nil
}
