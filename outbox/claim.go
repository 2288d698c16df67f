package outbox

import (
	"context"

	"github.com/idemq/idemq/internal/claim"
)

// Claim identifies the operation a handler is running: the scope of its
// idempotency key. Messages enqueued under it get deterministic message ids,
// the same on every retry of the operation, so that downstream consumers can
// deduplicate them too.
//
// Only the consumer runtime puts a claim into a handler's context, after it
// reserved the key; this package offers no way to set one, so no code can
// produce the message ids of another operation. ClaimFrom reads it.
type Claim struct {
	// Consumer, Tenant and Key are the scope of the key being handled.
	Consumer, Tenant, Key string
	// Step names an atomic phase (dedup.Store.Step) when the messages are
	// enqueued inside one; see WithStep.
	Step string
}

// WithStep returns a context whose claim is the one in ctx with Step set to
// step, and a fresh sequence. Use it around the messages of one atomic
// phase: a retry that skips completed steps then cannot reuse a completed
// step's message ids for another step's messages. Without a claim in ctx it
// returns ctx unchanged.
func WithStep(ctx context.Context, step string) context.Context {
	return claim.WithStep(ctx, step)
}

// ClaimFrom returns the claim carried by ctx, if any.
func ClaimFrom(ctx context.Context) (Claim, bool) {
	c, ok := claim.From(ctx)
	return Claim(c), ok
}

// MessageID returns the message id of the seq-th message (from 1) enqueued
// under claim c without a MessageID of its own: "idemq-" and 32 hex digits
// of SHA-256 over the length-prefixed consumer, tenant, key, step (when set)
// and seq. Every Enqueue under a handler's context that leaves
// Message.MessageID empty takes the next sequence number (1, 2, …), so a
// handler that enqueues the same messages in the same order on a retry
// produces the same message ids.
func MessageID(c Claim, seq int64) string {
	return claim.MessageID(claim.Claim(c), seq)
}
