// Package outboxsql owns the statements on the outbox's tables that a
// part other than package outbox must run the same way: the move of
// published rows into their record, which the relay runs and which
// `idemq scale` runs when it stands in for a relay.
package outboxsql

import "github.com/jackc/pgx/v5"

// MarkPublished is the statement that moves the outbox rows whose ids are
// $1 (bigint[]) out of the outbox (a delete writes no index entry) into
// the narrow record of published messages (migration 009), counting the
// publish as an attempt.
func MarkPublished(schema string) string {
	t := pgx.Identifier{schema, "outbox"}.Sanitize()
	published := pgx.Identifier{schema, "outbox_published"}.Sanitize()
	return `WITH moved AS (
    DELETE FROM ` + t + ` WHERE id = ANY($1)
    RETURNING id, message_id, exchange, routing_key, created_at, attempts + 1 AS attempts, returns
)
INSERT INTO ` + published + ` (id, message_id, exchange, routing_key, created_at, attempts, returns)
SELECT id, message_id, exchange, routing_key, created_at, attempts, returns FROM moved`
}
