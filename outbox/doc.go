// Package outbox is idemq's transactional outbox: messages written into
// Postgres in the caller's transaction, and a Relay that publishes them to
// RabbitMQ with publisher confirms.
//
// # The Outbox
//
// An Outbox (New) is the outbox table of one Postgres schema,
// <schema>.outbox, created by schema.Migrate (package
// github.com/idemq/idemq/dedup/schema). The schema is set there once:
// enqueueing, the relays built from it (NewRelay), the backlog (Pending) and
// retention (GC, GCParked, Unpark) all work on it.
//
// # Enqueue
//
// Outbox.Enqueue and Outbox.EnqueueBatch insert rows inside the caller's
// pgx.Tx, so a message exists if and only if the transaction that decided to
// send it commits: the handler's business rows, its outbox rows and its
// idempotency key's completion commit together or not at all. In a handler
// the consumer runs, the package-level Enqueue and EnqueueBatch do the same
// on the outbox the runtime put into the context (NewContext): that of the
// consumer's store.
//
// A message without a MessageID gets one derived from the claim the consumer
// runtime put into the handler's context (the scope of the key it reserved;
// see Claim): MessageID(claim, n) for the n-th such message, the same on
// every retry of the operation, so that downstream consumers can deduplicate
// it with their own idempotency keys. No public function sets a claim, so no
// code can produce another operation's ids. Without a claim a message gets a
// random UUID, fixed in the row, so re-publishes of that row still carry the
// same id. The caller's trace context, as Config.Propagator writes it, is
// stored with the row (traceparent and tracestate in columns, the rest of
// the carrier among its headers), and the relay's publish span continues it.
//
// # Relay
//
// A Relay claims pending rows in id order with SELECT … FOR UPDATE SKIP
// LOCKED, publishes them (mandatory, persistent by default) on a channel in
// confirm mode, waits for every confirm of the batch, marks the confirmed
// rows published and commits. Several relays can run side by side: each
// claims other rows. A relay wakes on LISTEN/NOTIFY (channel
// ChannelName(schema)) and polls as a fallback. The writers send the NOTIFY:
// Enqueue in the caller's transaction, delivered at its commit, or, where
// the library owns the commit (the consumer runtime, the idemhttp
// middleware) or the caller asked for it (WakeAfterCommit), Wake after the
// commit, outside any transaction: transactions that send a NOTIFY commit
// one at a time, the others side by side.
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
// way, until an operator calls Outbox.Unpark. The other rows keep flowing.
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
// Outbox.Pending reports the backlog (count, age of the oldest row, parked
// rows). Outbox.GC deletes published rows older than a retention in bounded
// batches; Outbox.GCParked and Outbox.Unpark handle parked rows. The relay
// exports OTel metrics (idemq.outbox.*), a producer span per published
// message that continues the trace stored in its row, and structured logs
// that never carry the broker URL. See docs/outbox.md for the table, the guarantees and measured figures.
package outbox
