// Package kit is the seam between package consumer and its public test kit,
// consumer/consumertest: the kit runs a handler through the runtime's own
// pipeline (claim, handler, completion, commit, settlement) without a
// broker, and that pipeline is not public API.
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
// at (nil for none) is called at each stage of the delivery's processing
// (see Stage); when it returns true the attempt crashes there, as a process
// that dies does: every transaction the attempt holds open is abandoned
// (its connection closed, without COMMIT or ROLLBACK), the heartbeat stops,
// nothing more is written, published or acked, and the lease is left to
// expire. Run.Crashed then reports it.
//
// Package consumer sets it when it is initialised.
var Process func(ctx context.Context, c any, d amqp.Delivery, at Hook) (Run, error)

// Hook is called by the pipeline at each stage of one delivery with the
// stage, the step's name for StageInStep and StageAfterStep, and the
// attempt's context (it carries the delivery's process span). It returns
// true to crash the attempt there. It runs on the goroutine that processes
// the delivery.
type Hook func(ctx context.Context, stage Stage, step string) (crash bool)

// Stage is a point of one delivery's processing where a process can die.
type Stage int

// The stages, in the order a delivery passes them.
const (
	// StageAfterReserve: the key is reserved (a lease held); the handler
	// has not run.
	StageAfterReserve Stage = iota + 1
	// StageInStep: a step's function returned without error; its
	// transaction has not committed.
	StageInStep
	// StageAfterStep: a step committed with its recovery point; the
	// handler has not gone on.
	StageAfterStep
	// StageBeforeCommit: the handler returned and the key is completed in
	// its transaction; that transaction has not committed.
	StageBeforeCommit
	// StageAfterCommit: the handler's transaction committed; the delivery
	// is not acked.
	StageAfterCommit
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
	// Crashed: the attempt crashed at Stage (the hook asked for it); TraceID
	// is the trace of its process span, "" when tracing is off.
	Crashed bool
	Stage   Stage
	TraceID string
}

// Publication is one message the pipeline published.
type Publication struct {
	Exchange, RoutingKey string
	Msg                  amqp.Publishing
}
