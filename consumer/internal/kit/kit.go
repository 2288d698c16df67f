// Package kit is the seam between package consumer and its public test kit,
// consumer/consumertest, which needs two things of the runtime that are not
// public API: to run a handler through the runtime's own pipeline (claim,
// handler, completion, commit, settlement) without a broker, and to crash a
// running consumer at the stages of its pipeline.
package kit

import (
	"context"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/dedup"
)

// Process takes one delivery through a consumer's pipeline, as if it had
// come from the broker, on a session whose publisher records the messages
// it would publish (the retry or dead-letter copy, the reply) and confirms
// each at once, and whose acks are recorded. c is a *consumer.Consumer that
// never ran (typed any: this package cannot import consumer, which imports
// it). It returns an error only when the run could not start (the store's
// schema is not migrated).
//
// Package consumer sets it when it is initialised.
var Process func(ctx context.Context, c any, d amqp.Delivery) (Run, error)

// SetCrash sets on c, a *consumer.Consumer that has not run, the hook its
// pipeline calls at each Stage. When the hook returns true the deliveries
// that reached the stage crash there: every transaction they hold open is
// abandoned (its connection closed under it, without COMMIT or ROLLBACK),
// their heartbeat stops, and the goroutine that processes them exits
// (runtime.Goexit), so nothing more is written, released, published or
// acked for them; their leases are left to expire. The rest of a process's
// death is the hook's to do before it returns true: close the consumer's
// broker connection (so that the broker requeues what it had not acked)
// and end the context of its Run (so that it does not reconnect).
//
// Package consumer sets it when it is initialised.
var SetCrash func(c any, h Hook)

// Hook is called by the pipeline at a stage that deliveries reached
// together: a group's reservation or commit, one delivery's step or
// settlement. It runs on the goroutine that processes them and returns true
// to crash them there.
type Hook func(at At) (crash bool)

// At is a stage some deliveries reached.
type At struct {
	Stage Stage
	// Step is the step's name, for StageInStep and StageAfterStep.
	Step string
	// Deliveries are the deliveries at the stage, as the broker delivered
	// them, and TraceIDs the traces of their process spans ("" where there
	// is none), in the same order.
	Deliveries []*amqp.Delivery
	TraceIDs   []string
	// Outcome is the delivery's outcome (a consumer.Outcome), at
	// StageSettled.
	Outcome string
}

// Stage is a point of a delivery's processing where a process can die.
type Stage int

// The stages, in the order a delivery passes them.
const (
	// StageAfterReserve: the keys are reserved (their leases held); no
	// handler has run.
	StageAfterReserve Stage = iota + 1
	// StageInStep: a step's function returned without error; its
	// transaction has not committed.
	StageInStep
	// StageAfterStep: a step committed with its recovery point; the
	// handler has not gone on.
	StageAfterStep
	// StageBeforeCommit: the handlers returned and their keys are completed
	// in the group's transaction, which has not committed.
	StageBeforeCommit
	// StageAfterCommit: the delivery's transaction committed; it is not
	// acked.
	StageAfterCommit
	// StageSettled: the delivery got its outcome (acked, or replaced by a
	// copy), as Config.OnOutcome reports it. Not a point to crash at: the
	// kit follows each delivery to its end there.
	StageSettled
)

// Run is what the pipeline did with one delivery, as the broker would have
// seen it.
type Run struct {
	// Claim is the delivery's claim: its scoped key and fingerprint. Zero
	// when the delivery could not be claimed (missing or invalid key or
	// tenant, a fingerprint that failed).
	Claim dedup.Claim
	// Published are the messages published while settling the delivery, in
	// order.
	Published []Publication
	// Acked: the delivery was acknowledged; Requeued: it was returned to
	// its queue instead.
	Acked, Requeued bool
}

// Publication is one message the pipeline published.
type Publication struct {
	Exchange, RoutingKey string
	Msg                  amqp.Publishing
}
