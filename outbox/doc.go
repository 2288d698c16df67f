// Package outbox is idemq's transactional outbox: messages written into
// Postgres in the caller's transaction, and a Relay that publishes them to
// RabbitMQ with publisher confirms.
//
// # Enqueue
//
// Enqueue (or Outbox.Enqueue, Outbox.EnqueueBatch) inserts rows into
// <schema>.outbox inside the caller's pgx.Tx, so a message exists if and
// only if the transaction that decided to send it commits: the handler's
// business rows, its outbox rows and its idempotency key's completion commit
// together or not at all. The table is created by dedup.Migrate.
//
// A message without a MessageID gets one derived from the claim carried by
// the context (WithClaim, set by the consumer runtime before a handler runs):
// MessageID(claim, n) for the n-th such message, the same on every retry of
// the operation, so that downstream consumers can deduplicate it with their
// own idempotency keys. Without a claim it gets a random UUID, fixed in the
// row, so re-publishes of that row still carry the same id. The caller's
// trace context (W3C traceparent/tracestate) is stored with the row.
//
// # Relay
//
// A Relay claims pending rows in id order with SELECT … FOR UPDATE SKIP
// LOCKED, publishes them (mandatory, persistent by default) on a channel in
// confirm mode, waits for every confirm of the batch, marks the confirmed
// rows published and commits. Several relays can run side by side: each
// claims other rows. A relay wakes on LISTEN/NOTIFY (channel
// ChannelName(schema), fired by a trigger at each committed insert) and polls
// as a fallback.
//
// Nothing is lost: a row is marked only after the broker confirmed it, in the
// transaction that holds its lock. A relay that dies or loses its broker
// connection between publishing and committing leaves the row pending, and it
// is published again, with the same message id: publishing is at least once.
//
// A message that comes back unroutable (basic.return), is nacked or is not
// confirmed in time stays in the table with attempts, last_error and an
// exponential backoff (available_at). Unroutable messages, and messages whose
// exchange does not exist, are logged at WARN and parked after
// RelayConfig.MaxReturns returns: they stay in the table, out of the relay's
// way, until an operator calls Unpark. The other rows keep flowing.
//
// # Ordering
//
// Rows with an OrderingKey are published one at a time per key, in id order
// (commit order when the key's writers are serialised), whatever the number
// of relays: a row is claimed only while no older row of its key is pending,
// and a transaction-scoped advisory lock per key keeps two relays from
// publishing the same key at once. The cost is one message per key per
// batch round trip; rows without a key are not affected.
//
// # Operations
//
// Pending reports the backlog (count, age of the oldest row, parked rows).
// GC deletes published rows older than a retention in bounded batches;
// GCParked and Unpark handle parked rows. The relay exports OTel metrics
// (idemq.outbox.*), a producer span per published message that continues the
// trace stored in its row, and structured logs that never carry the broker
// URL. See docs/outbox.md for the table, the guarantees and measured figures.
package outbox
