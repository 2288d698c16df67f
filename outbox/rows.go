package outbox

import (
	"cmp"
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Row is an outbox row waiting to be published, or parked: where it goes,
// what happened to it so far, and why it was parked.
type Row struct {
	ID                   int64
	Exchange, RoutingKey string
	// MessageID is the row's message_id (often the idempotency key).
	MessageID string
	BodySize  int
	CreatedAt time.Time
	// AvailableAt is when the relays try it next (a row in backoff after a
	// failed attempt waits until then).
	AvailableAt time.Time
	// Attempts counts the relays' tries; Returns those the broker returned
	// (unroutable, or its exchange missing).
	Attempts, Returns int
	// LastError is the last failed attempt's error.
	LastError string
	// ParkedAt and ParkedReason are set on a parked row.
	ParkedAt     *time.Time
	ParkedReason string
}

// DefaultRowsLimit bounds the rows Rows returns when its limit is 0.
const DefaultRowsLimit = 100

// Rows returns up to limit (0: DefaultRowsLimit) rows in id order: the
// pending ones (not published, not parked), or with parked the parked ones.
func (o *Outbox) Rows(ctx context.Context, parked bool, limit int) ([]Row, error) {
	where := "published_at IS NULL AND parked_at IS NULL"
	if parked {
		where = "parked_at IS NOT NULL"
	}
	rows, err := o.pool.Query(ctx, `SELECT id, exchange, routing_key, message_id, length(body), created_at,
    available_at, attempts, returns, coalesce(last_error, ''), parked_at, coalesce(parked_reason, '')
FROM `+o.table+` WHERE `+where+` ORDER BY id LIMIT $1`, cmp.Or(limit, DefaultRowsLimit))
	if err != nil {
		return nil, fmt.Errorf("outbox: rows: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Row, error) {
		var w Row
		err := r.Scan(&w.ID, &w.Exchange, &w.RoutingKey, &w.MessageID, &w.BodySize, &w.CreatedAt,
			&w.AvailableAt, &w.Attempts, &w.Returns, &w.LastError, &w.ParkedAt, &w.ParkedReason)
		return w, err
	})
	if err != nil {
		return nil, fmt.Errorf("outbox: rows: %w", err)
	}
	return out, nil
}
