// Package propagator owns the default text-map propagator of the consumer
// and the outbox: the global one once a program has set it, else W3C Trace
// Context and Baggage, so that a trace continues across RabbitMQ, retries
// and the outbox in a program that never called otel.SetTextMapPropagator.
package propagator

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
)

// W3C is the W3C Trace Context and Baggage propagator.
var W3C propagation.TextMapPropagator = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

// Or returns p, or Default() when p is nil.
func Or(p propagation.TextMapPropagator) propagation.TextMapPropagator {
	if p != nil {
		return p
	}
	return Default()
}

// Default returns the propagator used when a config names none. It decides
// at each use: the global propagator when it has fields (a program set one,
// before or after the consumer or relay was made), else W3C (the global
// default is a no-op: no fields, nothing injected or extracted).
func Default() propagation.TextMapPropagator { return fallback{} }

type fallback struct{}

func current() propagation.TextMapPropagator {
	if g := otel.GetTextMapPropagator(); len(g.Fields()) > 0 {
		return g
	}
	return W3C
}

func (fallback) Inject(ctx context.Context, c propagation.TextMapCarrier) { current().Inject(ctx, c) }

func (fallback) Extract(ctx context.Context, c propagation.TextMapCarrier) context.Context {
	return current().Extract(ctx, c)
}

func (fallback) Fields() []string { return current().Fields() }
