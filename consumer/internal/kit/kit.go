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
// Package consumer sets it when it is initialised.
var Process func(ctx context.Context, c any, d amqp.Delivery) (Run, error)

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
