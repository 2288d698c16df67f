// Package claim carries, in a handler's context, the operation the handler
// runs: the scope of its idempotency key. The outbox derives the message ids
// of that operation from it, the same on every retry, so that downstream
// consumers can deduplicate them.
//
// Only the consumer runtime puts a claim into a context (With), after it
// reserved the key: were it settable through a public helper, any code could
// produce another operation's message ids. The outbox reads it (From, Next)
// and lets handlers mark an atomic phase (WithStep).
package claim

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"sync/atomic"
)

// Claim is the operation a handler runs: the scope of its key and, inside an
// atomic phase, the phase's name.
type Claim struct {
	Consumer, Tenant, Key string
	// Step names the atomic phase (dedup.Store.Step) the messages are
	// enqueued in, if any.
	Step string
}

type ctxKey struct{}

// value is a claim with the sequence of the messages enqueued under it.
type value struct {
	Claim
	seq *atomic.Int64
}

// With returns a context carrying c and a fresh message sequence. The
// consumer runtime calls it before each run of a handler.
func With(ctx context.Context, c Claim) context.Context {
	return context.WithValue(ctx, ctxKey{}, &value{Claim: c, seq: new(atomic.Int64)})
}

// WithStep returns a context whose claim is the one in ctx with Step set to
// step, and a fresh sequence; without a claim in ctx, ctx unchanged.
func WithStep(ctx context.Context, step string) context.Context {
	v, ok := from(ctx)
	if !ok {
		return ctx
	}
	next := v.Claim
	next.Step = step
	return With(ctx, next)
}

// From returns the claim carried by ctx, if any.
func From(ctx context.Context) (Claim, bool) {
	v, ok := from(ctx)
	if !ok {
		return Claim{}, false
	}
	return v.Claim, true
}

// Next takes the next sequence number of the claim in ctx and returns the
// message id it derives; ok is false when ctx carries no claim.
func Next(ctx context.Context) (id string, ok bool) {
	v, ok := from(ctx)
	if !ok {
		return "", false
	}
	return MessageID(v.Claim, v.seq.Add(1)), true
}

func from(ctx context.Context) (*value, bool) {
	v, ok := ctx.Value(ctxKey{}).(*value)
	return v, ok
}

// MessageID returns the message id of the seq-th message (from 1) enqueued
// under c: "idemq-" and 32 hex digits of SHA-256 over the length-prefixed
// consumer, tenant, key, step (when set) and seq.
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
