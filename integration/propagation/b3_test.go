// Package propagation_test checks that a trace crosses the outbox in the
// propagator the program configured, whatever it is. The package sets no
// global propagator, so every context that travels does so through the
// configured ones.
package propagation_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/contrib/propagators/b3"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/outbox"
)

// TestB3AcrossTheOutbox: a consumer and a relay configured with B3 (and
// W3C baggage), no global propagator. A message published with B3 headers is
// processed, its handler enqueues a message through the consumer's outbox,
// and the relay publishes it: the relayed message carries B3 headers of the
// same trace (the relay's publish span, a child of the handler's), the
// baggage, and no W3C traceparent; the next stage's processing is in that
// trace too.
func TestB3AcrossTheOutbox(t *testing.T) {
	if f := otel.GetTextMapPropagator().Fields(); len(f) != 0 {
		t.Fatalf("a global propagator is set (%q): this test must run without one", f)
	}
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	prop := propagation.NewCompositeTextMapPropagator(b3.New(b3.WithInjectEncoding(b3.B3MultipleHeader)), propagation.Baggage{})

	e := testenv.New(t)
	cfgA, eventsA := e.ConsumerConfig("it.b3.orders", "orders")
	cfgB, eventsB := e.ConsumerConfig("it.b3.shipping", "shipping")
	for _, c := range []*consumer.Config{&cfgA, &cfgB} {
		c.TracerProvider, c.Propagator = tp, prop
	}
	e.Run(cfgA, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		// The package-level Enqueue: the consumer's own outbox, with the
		// consumer's propagator.
		return consumer.Response{}, outbox.Enqueue(ctx, tx, outbox.Message{RoutingKey: cfgB.Queue, Body: d.Body, MessageID: "ship-" + d.Key})
	})
	relayed := make(chan amqp.Table, 1)
	e.Run(cfgB, func(_ context.Context, _ pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		relayed <- d.Headers
		return consumer.Response{}, nil
	})
	ob, err := outbox.New(e.Pool, &outbox.Config{Schema: e.Schema, Propagator: prop})
	if err != nil {
		t.Fatal(err)
	}
	relay, err := outbox.NewRelay(ob, testamqp.URL(), &outbox.RelayConfig{TracerProvider: tp, Propagator: prop})
	if err != nil {
		t.Fatal(err)
	}
	e.RunFunc(relay.Run)

	member, err := baggage.NewMember("order.channel", "web")
	if err != nil {
		t.Fatal(err)
	}
	bag, err := baggage.New(member)
	if err != nil {
		t.Fatal(err)
	}
	ctx, root := tp.Tracer("test").Start(baggage.ContextWithBaggage(context.Background(), bag), "checkout publish", trace.WithSpanKind(trace.SpanKindProducer))
	headers := amqp.Table{}
	prop.Inject(ctx, headerCarrier(headers))
	root.End()
	if _, ok := headers["x-b3-traceid"]; !ok {
		t.Fatalf("the publisher's headers carry no B3 trace id: %v", headers)
	}
	e.Publish(cfgA.Queue, "order-1", `{"order":1}`, headers)
	rootTrace := root.SpanContext().TraceID().String()

	if ev := testenv.WaitOutcome(t, eventsA, consumer.OutcomeProcessed); ev.TraceID != rootTrace {
		t.Fatalf("stage 1 in trace %s, want the publisher's %s", ev.TraceID, rootTrace)
	}
	evB := testenv.WaitOutcome(t, eventsB, consumer.OutcomeProcessed)
	got := <-relayed
	if evB.TraceID != rootTrace {
		t.Errorf("stage 2 in trace %s, want the publisher's %s (relayed headers %v)", evB.TraceID, rootTrace, got)
	}
	if id, _ := got["x-b3-traceid"].(string); id != rootTrace {
		t.Errorf("relayed x-b3-traceid %q, want %s (headers %v)", id, rootTrace, got)
	}
	if _, ok := got["traceparent"]; ok {
		t.Errorf("relayed message carries a W3C traceparent though only B3 is configured: %v", got)
	}
	if b, _ := got["baggage"].(string); b != "order.channel=web" {
		t.Errorf("relayed baggage %q, want order.channel=web", b)
	}
	// The relayed B3 span id is the relay's publish span, a child of the
	// handler span that enqueued it.
	// The relay ends its publish span once the broker confirmed the
	// message, which may be after stage 2 handled it: wait for both spans.
	var publish, handler sdktrace.ReadOnlySpan
	deadline := time.After(10 * time.Second)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for publish == nil || handler == nil {
		publish, handler = nil, nil
		for _, s := range spans.Ended() {
			switch s.Name() {
			case "amq.default publish":
				publish = s
			case "idemq handler":
				if s.SpanContext().TraceID().String() == rootTrace && handler == nil {
					handler = s
				}
			}
		}
		if publish != nil && handler != nil {
			break
		}
		select {
		case <-tick.C:
		case <-deadline:
			t.Fatalf("no relay publish span or handler span among %d spans after 10s", len(spans.Ended()))
		}
	}
	if publish.SpanContext().TraceID().String() != rootTrace || publish.Parent().SpanID() != handler.SpanContext().SpanID() {
		t.Errorf("relay publish span %s in trace %s, parent %s; want trace %s, parent the handler %s",
			publish.SpanContext().SpanID(), publish.SpanContext().TraceID(), publish.Parent().SpanID(), rootTrace, handler.SpanContext().SpanID())
	}
	if id, _ := got["x-b3-spanid"].(string); id != publish.SpanContext().SpanID().String() {
		t.Errorf("relayed x-b3-spanid %q, want the relay's publish span %s", id, publish.SpanContext().SpanID())
	}
}

// headerCarrier adapts amqp.Table to propagation.TextMapCarrier for the
// test's publisher.
type headerCarrier amqp.Table

func (c headerCarrier) Get(key string) string {
	s, _ := c[key].(string)
	return s
}
func (c headerCarrier) Set(key, value string) { c[key] = value }
func (c headerCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}
