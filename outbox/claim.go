package outbox

import (
	"context"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/claim"
)

// The operation a handler is running is the scope of its idempotency key
// (dedup.Scope). Messages enqueued under it get deterministic message ids,
// the same on every retry of the operation, so that downstream consumers
// can deduplicate them too.
//
// Only the runtime (the consumer, the HTTP middleware) puts a scope into a
// handler's context, after it reserved the key; this package offers no way
// to set one, so no code can produce the message ids of another operation.
// ScopeFrom reads it.

// WithStep returns a context whose scope is the one in ctx, inside the
// atomic phase step (dedup.Store.Step), with a fresh sequence. Use it around
// the messages of one atomic phase: a retry that skips completed steps then
// cannot reuse a completed step's message ids for another step's messages.
// Without a scope in ctx it returns ctx unchanged.
func WithStep(ctx context.Context, step string) context.Context {
	return claim.WithStep(ctx, step)
}

// ScopeFrom returns the scope of the key the handler runs under, carried by
// ctx, and the atomic phase it is in ("" outside one), if any.
func ScopeFrom(ctx context.Context) (sc dedup.Scope, step string, ok bool) {
	return claim.From(ctx)
}

// MessageID returns the message id of the seq-th message (from 1) enqueued
// under scope sc, in atomic phase step ("" for none), without a MessageID of
// its own: "idemq-" and 32 hex digits of SHA-256 over the length-prefixed
// consumer, tenant, key, step (when set) and seq. Every Enqueue under a
// handler's context that leaves Message.MessageID empty takes the next
// sequence number (1, 2, …), so a handler that enqueues the same messages in
// the same order on a retry produces the same message ids.
func MessageID(sc dedup.Scope, step string, seq int64) string {
	return claim.MessageID(sc, step, seq)
}
