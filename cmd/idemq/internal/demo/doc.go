// Package demo is the payments scenario of `idemq demo` (and `make demo`):
// the whole of idemq shown end to end on a real Postgres and a real RabbitMQ.
//
// # What it does
//
// Run resets a demo schema (schema.Migrate plus a charges ledger) and a demo
// queue topology, starts worker processes, publishes thousands of payment
// messages with publisher confirms, kills one worker with SIGKILL mid-run and
// starts a replacement, waits until every message has settled, stops the
// workers with SIGTERM (graceful drain) and prints a report computed from the
// database and the queues.
//
// The messages, in publication order, mix:
//
//   - unique payments, message_id = the idempotency key;
//   - sequential redeliveries of earlier payments (some right behind the
//     original, some long after it completed);
//   - bursts of 20 copies of one key, published from 20 goroutines at once;
//   - key reuse: the same key with another amount (a different operation);
//   - poison: a body that is not JSON, or a payment without an account;
//   - messages without a key, and keys that are invalid (a control character,
//     or longer than 255 bytes, sent in the Idempotency-Key header because a
//     message_id cannot hold them).
//
// The workers' handler charges a card: it inserts one row into the ledger in
// the handler's transaction. Amounts above 9000 are rejected ("insufficient
// funds", stored and replayed to duplicates). About 5% of keys hit an
// injected infrastructure failure on their first attempt (decided from a hash
// of the key) and go through the retry tiers; payments on the "discover"
// network fail on every attempt and end in the DLQ with
// max_attempts_exceeded.
//
// # Workers are processes
//
// Workers are real processes: the running executable started again with the
// same arguments and the environment variable IDEMQ_DEMO_WORKER holding the
// worker's configuration (JSON). Run checks that variable first: in a worker
// it consumes until SIGTERM (or until its parent goes away), then drains and
// returns. So one binary serves both roles; a test does the same through
// TestMain (see IsWorker).
//
// # When the run is over
//
// Workers record every consumer.Event in an events table (batched, outside
// the handler's transaction), which drives the progress line and the kill.
// Events are best effort (a killed worker loses its last batch), so they
// never decide the end: the run is settled when the publisher is done, the
// work queue and the retry tiers are empty and no key is held under a lease,
// checked again after the workers stopped (a running worker may hold
// prefetched messages that no queue counter shows; a stopped one returns
// them). If something is left, the workers start again. Options.Timeout
// bounds it all.
//
// # The report
//
// The report is computed from the database (key rows, ledger, the log of
// confirmed publications) and from the queues (the DLQ is read, by reason,
// and left in place). Unique keys are the keys whose first publication is a
// valid payment. The invariant: each of them ends processed (exactly one
// ledger row), rejected (none) or dead-lettered after its attempts (none,
// and a copy in the DLQ); no key has two ledger rows and no ledger row lacks
// a processed key; no key is left in progress; the work queue and the retry
// tiers are empty; every poison, reuse and bad-key message reached the DLQ.
// Run returns an error when it does not hold.
//
// # The HTTP front door
//
// Then (unless Options.HTTPPayments is negative) the same chain starts one
// step earlier, at an HTTP client: the workers consume again, an idemq
// gateway (package gateway, in process) publishes into the work queue, and
// 16 clients POST payments to it, each under a key of its own, giving up
// after 400ms and sending the same key again, as a browser's spinner or a
// client library does. A quarter of the operations meet a slow card network
// (their first run takes 1.2s inside the key's lease: the client times out,
// its retry gets 409 with Retry-After, then the stored 202), some lose their
// answer after the commit (the retry gets the replay) and some are double
// clicks (two submissions at once). The report counts HTTP attempts, 202s
// accepted and replayed, 409s, timeouts and lost answers, the messages the
// gateway published (one per key, message_id = the key) and the ledger's
// charges, which must equal the unique operations with none doubled.
package demo
