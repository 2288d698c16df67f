// Package claim carries, in a handler's context, the operation the handler
// runs: the scope of its idempotency key. The outbox derives the message ids
// of that operation from it, the same on every retry, so that downstream
// consumers can deduplicate them.
//
// Only the runtime (the consumer, the HTTP middleware) puts a scope into a
// context (With), after it reserved the key: were it settable through a
// public helper, any code could produce another operation's message ids.
// The outbox reads it (From, Next) and lets handlers mark an atomic phase
// (WithStep).
package claim

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"sync/atomic"

	"github.com/idemq/idemq/dedup"
)

type ctxKey struct{}

// value is the scope of the operation a handler runs, the atomic phase it
// is in (if any) and the sequence of the messages enqueued under them.
type value struct {
	scope dedup.Scope
	step  string
	seq   *atomic.Int64
}

// With returns a context carrying sc, the scope of the key the handler
// runs under, and a fresh message sequence. The runtime calls it before
// each run of a handler.
func With(ctx context.Context, sc dedup.Scope) context.Context {
	return with(ctx, sc, "")
}

func with(ctx context.Context, sc dedup.Scope, step string) context.Context {
	return context.WithValue(ctx, ctxKey{}, &value{scope: sc, step: step, seq: new(atomic.Int64)})
}

// WithStep returns a context whose scope is the one in ctx, inside the
// atomic phase step (dedup.Store.Step), with a fresh sequence; without a
// scope in ctx, ctx unchanged.
func WithStep(ctx context.Context, step string) context.Context {
	v, ok := from(ctx)
	if !ok {
		return ctx
	}
	return with(ctx, v.scope, step)
}

// From returns the scope carried by ctx and the atomic phase, if any.
func From(ctx context.Context) (sc dedup.Scope, step string, ok bool) {
	v, ok := from(ctx)
	if !ok {
		return dedup.Scope{}, "", false
	}
	return v.scope, v.step, true
}

// Next takes the next sequence number of the scope in ctx and returns the
// message id it derives; ok is false when ctx carries no scope.
func Next(ctx context.Context) (id string, ok bool) {
	v, ok := from(ctx)
	if !ok {
		return "", false
	}
	return MessageID(v.scope, v.step, v.seq.Add(1)), true
}

func from(ctx context.Context) (*value, bool) {
	v, ok := ctx.Value(ctxKey{}).(*value)
	return v, ok
}

// MessageID returns the message id of the seq-th message (from 1) enqueued
// under sc, in atomic phase step ("" for none): "idemq-" and 32 hex digits
// of SHA-256 over the length-prefixed consumer, tenant, key, step (when
// set) and seq.
func MessageID(sc dedup.Scope, step string, seq int64) string {
	h := sha256.New()
	parts := []string{sc.Consumer, sc.Tenant, sc.Key}
	if step != "" {
		parts = append(parts, "step", step)
	}
	parts = append(parts, strconv.FormatInt(seq, 10))
	for _, p := range parts {
		fmt.Fprintf(h, "%d:%s;", len(p), p)
	}
	return "idemq-" + hex.EncodeToString(h.Sum(nil))[:32]
}
