package propagator

import (
	"context"
	"slices"
	"testing"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// The test sets the global propagator, so it stays in this package, whose
// other tests do not depend on the global.
func TestDefaultFollowsTheGlobalOnceSet(t *testing.T) {
	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2}, TraceFlags: trace.FlagsSampled,
	})
	ctx := trace.ContextWithSpanContext(context.Background(), sc)
	if f := otel.GetTextMapPropagator().Fields(); len(f) != 0 {
		t.Fatalf("global propagator already set: %v", f)
	}
	p := Default()
	if got := p.Fields(); !slices.Contains(got, "traceparent") || !slices.Contains(got, "baggage") {
		t.Fatalf("default fields %v while the global is the no-op, want W3C trace context and baggage", got)
	}
	c := propagation.MapCarrier{}
	p.Inject(ctx, c)
	if c["traceparent"] == "" {
		t.Fatal("no traceparent injected while the global is the no-op")
	}
	if got := trace.SpanContextFromContext(p.Extract(context.Background(), c)); got.TraceID() != sc.TraceID() {
		t.Fatalf("extracted trace %s, want %s", got.TraceID(), sc.TraceID())
	}

	// A program sets its own propagator after the consumer was made: it wins.
	prev := otel.GetTextMapPropagator()
	otel.SetTextMapPropagator(propagation.Baggage{})
	t.Cleanup(func() { otel.SetTextMapPropagator(prev) })
	c = propagation.MapCarrier{}
	p.Inject(ctx, c)
	if _, ok := c["traceparent"]; ok || !slices.Equal(p.Fields(), []string{"baggage"}) {
		t.Fatalf("default still W3C after the global was set: carrier %v, fields %v", c, p.Fields())
	}
	if mine := (propagation.TraceContext{}); Or(mine) != propagation.TextMapPropagator(mine) {
		t.Fatal("Or replaced a configured propagator")
	}
}
