// Package conformance is the protocol's one suite of scenarios, run
// against every door into it: the HTTP middleware (dedup/idemhttp) and the
// RabbitMQ consumer in each of its modes, as watermill's
// tests.TestPubSub runs one suite against every backend.
//
// # Doors
//
// A Door is what a scenario drives: Send starts one operation (a key, a
// tenant, a body) and its Pending tells what the door's user sees of it,
// in one vocabulary (Result): processed, duplicate, in_progress,
// key_reuse, rejected, retried, lease_lost, invalid_key. The HTTP door
// maps statuses, problem codes and Idempotent-Replayed onto it, and is a
// client that retries 5xx, 409 and a cut connection with the same key, as
// the Idempotency-Key draft asks of clients; a consumer door maps the
// Event that Config.OnOutcome reports and the reply the message asked for.
// Each door runs one handler, the suite's (Handle), which records its
// call, writes one effect row in the handler's transaction and does what
// the scenario asked for that key (succeed, reject, fail, block).
//
// # Features
//
// What a door cannot do the same way is declared in its Features, and the
// scenario adapts its meaning (a door whose keys are held by the group's
// transaction has no lease others can see: a second copy waits for the
// first's commit instead of finding the key busy). A scenario a door
// cannot run at all is skipped with its reason printed; none is today.
package conformance
