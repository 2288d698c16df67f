package outbox

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"sync/atomic"
)

// Claim identifies the operation a handler is running: the scope of its
// idempotency key. Messages enqueued under it get deterministic message ids,
// the same on every retry of the operation, so that downstream consumers can
// deduplicate them too.
type Claim struct {
	// Schema is the Postgres schema of the outbox ("" = dedup.DefaultSchema),
	// used by the package-level Enqueue.
	Schema string
	// Consumer, Tenant and Key are the scope of the key being handled.
	Consumer, Tenant, Key string
	// Step names an atomic phase (dedup.Store.Step) when the messages are
	// enqueued inside one; see WithStep.
	Step string
}

type claimKey struct{}

type claimValue struct {
	Claim
	seq *atomic.Int64
}

// WithClaim returns a context carrying c and a fresh message sequence. The
// consumer runtime calls it before each run of a handler. Every Enqueue
// under the returned context that leaves Message.MessageID empty takes the
// next sequence number (1, 2, …) and gets MessageID(c, n), so a handler that
// enqueues the same messages in the same order on a retry produces the same
// message ids.
func WithClaim(ctx context.Context, c Claim) context.Context {
	return context.WithValue(ctx, claimKey{}, &claimValue{Claim: c, seq: new(atomic.Int64)})
}

// WithStep returns a context whose claim is the one in ctx with Step set to
// step, and a fresh sequence. Use it around the messages of one atomic
// phase: a retry that skips completed steps then cannot reuse a completed
// step's message ids for another step's messages. Without a claim in ctx it
// returns ctx unchanged.
func WithStep(ctx context.Context, step string) context.Context {
	c, ok := claimFrom(ctx)
	if !ok {
		return ctx
	}
	next := c.Claim
	next.Step = step
	return WithClaim(ctx, next)
}

// ClaimFrom returns the claim carried by ctx, if any.
func ClaimFrom(ctx context.Context) (Claim, bool) {
	c, ok := claimFrom(ctx)
	if !ok {
		return Claim{}, false
	}
	return c.Claim, true
}

func claimFrom(ctx context.Context) (*claimValue, bool) {
	c, ok := ctx.Value(claimKey{}).(*claimValue)
	return c, ok
}

// MessageID returns the message id of the seq-th message (from 1) enqueued
// under claim c: "idemq-" and 32 hex digits of SHA-256 over the
// length-prefixed consumer, tenant, key, step (when set) and seq.
func MessageID(c Claim, seq int64) string {
	h := sha256.New()
	parts := []string{c.Consumer, c.Tenant, c.Key}
	if c.Step != "" {
		parts = append(parts, "step", c.Step)
	}
	parts = append(parts, strconv.FormatInt(seq, 10))
	for _, p := range parts {
		fmt.Fprintf(h, "%d:%s;", len(p), p)
	}
	return "idemq-" + hex.EncodeToString(h.Sum(nil))[:32]
}
