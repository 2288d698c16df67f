// Package consumertest tests code built on package consumer: handlers run
// through the runtime's own pipeline against a real Postgres, without a
// broker (RunHandler), or by real consumers against a real RabbitMQ too,
// crashed at every point a process can die (CrashPoints).
//
// # Running a handler
//
// RunHandler (or a Runner, for a configured consumer) delivers one message
// to a handler the way a consumer does: the key is claimed in the store
// with a real lease, the handler runs in a real transaction under the
// handler timeout, with the claim in its context, so that outbox.Enqueue
// derives message ids and Delivery.Step and Delivery.DerivedKey work; a
// panic is recovered; the key is completed in the same transaction and
// committed; the outcome is routed. The Result says what happened: the
// outcome (processed, rejected, retried, dead-lettered, duplicate...), the
// failure or the rejection, the stored response, the key's row, and the
// retry or dead-letter copy the runtime would have published.
//
//	store := deduptest.Store(t, pool, nil)
//	res := consumertest.RunHandler(t, store, charge, amqp.Publishing{MessageId: "order-1", Body: body})
//	if res.Outcome != consumer.OutcomeProcessed {
//		t.Fatalf("outcome %s: %v", res.Outcome, res.Err)
//	}
//
// Running the same message again is a redelivery: a duplicate, which does
// not reach the handler, once the key completed; after a retried run, the
// handler runs again and resumes after the last step the earlier run
// committed. Running res.Copy.Publishing delivers the retry copy, with the
// next attempt number.
//
// # Crash points
//
// CrashPoints runs deliveries through a handler once per crash point, on a
// fresh Subject each time (store, handler, check), with real consumers of a
// real RabbitMQ queue of the point's own: the deliveries are published to
// it, and the worker that holds a delivery when it reaches the point dies
// there as a process does: its broker connection drops (the broker
// requeues what it had not acked), its open transactions are abandoned,
// its leases are left to expire. A new worker consumes what the broker
// redelivers and takes the keys over once their leases expired; when every
// delivery ended, the Subject's Check says whether the end state is right.
// The points: after the reservation, inside and after each Step, after the
// handler before COMMIT, after COMMIT before the ack, and (with a
// Downstream) the outbox's two; and the scenarios of a duplicate copy
// during and after the first and of a lease that expires under a slow
// handler. Each runs in one of the consumer's modes (single, group,
// optimistic, batch: Subject.Mode, Modes). The CrashReport has one row per
// point, with the traces of the attempts that crashed.
//
//	rep := consumertest.CrashPoints(t, setup, msgs...)
//	if err := rep.Err(); err != nil {
//		t.Fatal(err)
//	}
//
// # Waiting in integration tests
//
// WaitFor polls a condition until it holds or a deadline passes, for tests
// that run a real consumer and wait for what it does.
//
// # The database
//
// Package dedup/deduptest gives each test a schema of its own, migrated and
// dropped at the end of the test. Nothing here reads an environment
// variable: the test brings its pool.
package consumertest
