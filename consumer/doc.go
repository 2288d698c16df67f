// Package consumer is idemq's RabbitMQ runtime: it consumes a work queue,
// claims each message's idempotency key in Postgres before the handler runs,
// and routes every delivery to exactly one outcome.
//
// # Adopting it
//
//	c, err := consumer.New(store, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
//		_, err := tx.Exec(ctx, "INSERT INTO charges (order_id, body) VALUES ($1, $2)", d.Key, d.Body)
//		return consumer.Response{Code: 201}, err
//	}, &consumer.Config{URL: amqpURL, Queue: "payments", Name: "charge"})
//	err = c.Run(ctx)
//
// Whatever the handler writes in tx commits together with the key's
// completion and its outbox rows (outbox.Enqueue), or not at all. The
// handler never sees a duplicate.
//
// # Outcomes
//
// A returned Response completes the key (outcome "processed"); Reject stores
// a business rejection that duplicates get back ("rejected"); Permanent sends
// the message to the DLQ ("dead_lettered", reason permanent_error); any other
// error, a panic or a timeout releases the key and retries the message
// through a delay tier, then dead-letters it after MaxAttempts. Duplicates
// are acked ("duplicate"), busy keys come back later ("in_progress"), reused
// and invalid keys go to the DLQ with their reason. A message is acked only
// after what replaces it is durable: the commit, or a publisher-confirmed copy.
// Acks are coalesced into multiple-acks up to the lowest delivery still in
// flight (IndividualAcks turns that off).
//
// # Topology
//
// Work queue Q (quorum, x-delivery-limit), retry tiers Q.retry.<delay> (TTL,
// dead-lettering back to Q at least once), and Q.dlx → Q.dlq. Declared on
// every connect unless SkipDeclare, or by Apply.
//
// # Copies and their headers
//
// A retry or dead-letter copy keeps the body, the properties (not user_id,
// which RabbitMQ accepts only from the publisher's own user) and the
// headers, and adds idemq's x-idemq-* headers: the attempt, the tenant, the
// first-seen time, the original exchange and routing key, signed with an
// HMAC (HeaderSignature) keyed by Config.HeaderKeys, else by the key Migrate
// created in the schema. Those headers are trusted only on a copy whose
// signature verifies; on any other delivery they are removed, and the
// delivery is a first attempt with its own tenant and routing key.
//
// # One pipeline, eight modes
//
// Every delivery goes through one pipeline: a collector forms groups
// (Config.Group: Size, Linger) for Concurrency executors; a group's keys are
// reserved with one statement; its handlers run in one transaction, which
// commits once; each delivery is then settled. New chooses, once, how the
// handlers run: each under its own savepoint (the default; Group.Size 1 is
// one transaction per message), Group.Optimistic without savepoints (a group
// whose handler fails runs again with them), or a BatchHandler (NewBatch)
// for the whole group in one call. It chooses how the keys are held: in the
// group's transaction in every mode (one commit per group), or, with
// Config.SeparateReservations or Config.Steps, as leases others can see,
// reserved before the transaction and extended by one heartbeat that cancels
// exactly the handlers whose lease was lost. Mode names the eight
// combinations (Modes); Mode.Apply sets them in a Config. A handler that
// calls Delivery.Step needs Config.Steps. A failing message never fails its
// group-mates. In every mode HandlerTimeout bounds one call of user code,
// and the transaction a handler gets refuses Commit and Rollback
// (ErrHandlerTx). Details: docs/consumer.md.
//
// # Connections
//
// Run owns the reconnect loop (with backoff), re-declares the topology and
// consumes again; when its context ends it stops consuming, lets in-flight
// handlers finish within ShutdownTimeout, acks them and returns nil. Before
// its first consume it returns an error for what retrying cannot fix: a
// schema not migrated (dedup.Store.Check: run `idemq migrate`), a malformed
// URL, credentials or a vhost the broker refuses. Ready tells a readiness
// probe whether the consumer consumes.
//
// # Logs
//
// Handler failures are logged when they happen (a retry as well as a dead
// letter), with the outcome, the reason and the key hash, never the key; at
// most 10 lines a second per consumer, the next line saying how many were
// suppressed.
//
// # Testing handlers
//
// Package consumer/consumertest runs a handler through this pipeline against
// a real Postgres without a broker (RunHandler) and reports the outcome, the
// stored response and the copy that would have been published.
package consumer
