package consumer_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/outbox"
)

// TestTraceContinuesWithoutAGlobalPropagator runs a consumer, its outbox and
// a relay in a program that never set the global propagator (no test of
// this package sets it): the retry continues the publisher's trace, the
// outbox row carries the handler's traceparent and the relay's publish span
// continues the handler's trace. Group and single modes: there each
// handler's context is a span of the delivery's trace (a BatchHandler's is
// the batch's own span, linked to each delivery).
func TestTraceContinuesWithoutAGlobalPropagator(t *testing.T) {
	if f := otel.GetTextMapPropagator().Fields(); len(f) != 0 {
		t.Fatalf("the global propagator is set (fields %v); this test needs the no-op default", f)
	}
	for _, m := range []mode{modeGroup, modeSingle} {
		t.Run(string(m), func(t *testing.T) {
			t.Parallel()
			rec := tracetest.NewSpanRecorder()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
			t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
			h := newHarness(t, m, func(c *consumer.Config) { c.TracerProvider = tp })
			sink := testamqp.Name(t, "sink")
			testamqp.DeleteQueuesAtCleanup(t, []string{sink}, nil)
			if _, err := h.pub.QueueDeclare(sink, true, false, false, false, nil); err != nil {
				t.Fatal(err)
			}
			h.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
				if d.Attempt == 1 {
					return consumer.Response{}, errInfra
				}
				if err := outbox.Enqueue(ctx, tx, outbox.Message{RoutingKey: sink, Body: d.Body}); err != nil {
					return consumer.Response{}, err
				}
				return h.ledgerEffect(ctx, tx, d)
			})

			// The publisher writes its span's W3C traceparent.
			pctx, root := tp.Tracer("test").Start(context.Background(), "checkout publish", trace.WithSpanKind(trace.SpanKindProducer))
			headers := amqp.Table{}
			carrier := propagation.MapCarrier{}
			propagation.TraceContext{}.Inject(pctx, carrier)
			for k, v := range carrier {
				headers[k] = v
			}
			h.publish("order-1", `{"order":1}`, headers)
			root.End()
			want := root.SpanContext().TraceID()

			evs := h.waitEvents(30*time.Second, "processing on the second attempt", func(evs []consumer.Event) bool {
				return countOutcomes(evs)[consumer.OutcomeProcessed] == 1
			})
			for _, ev := range evs {
				if ev.TraceID != want.String() {
					t.Errorf("attempt %d (%s) in trace %s, want the publisher's %s", ev.Attempt, ev.Outcome, ev.TraceID, want)
				}
			}
			if n := countOutcomes(evs)[consumer.OutcomeRetried]; n != 1 {
				t.Errorf("%d retried outcomes, want 1: %v", n, evs)
			}

			// The row carries the traceparent of the handler that enqueued it.
			var traceparent *string
			if err := h.pool.QueryRow(context.Background(), "SELECT traceparent FROM "+h.schema+".outbox").Scan(&traceparent); err != nil {
				t.Fatal(err)
			}
			if traceparent == nil {
				t.Fatal("the outbox row has no traceparent")
			}
			rowSC := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(),
				propagation.MapCarrier{"traceparent": *traceparent}))
			handler := spanByID(t, rec, rowSC.SpanID())
			if rowSC.TraceID() != want || handler.Name() != "idemq handler" {
				t.Errorf("outbox row traceparent %q names span %q of trace %s, want the handler's, in trace %s",
					*traceparent, handler.Name(), rowSC.TraceID(), want)
			}

			// The relay's publish span continues the handler's trace, and
			// the message it publishes carries that span's context.
			ob, err := outbox.New(h.pool, &outbox.Config{Schema: h.schema})
			if err != nil {
				t.Fatal(err)
			}
			relay, err := outbox.NewRelay(ob, testamqp.URL(), &outbox.RelayConfig{
				TracerProvider: tp, PollInterval: 100 * time.Millisecond, ConnectionName: "idemq-test-relay-" + h.cfg.Queue,
			})
			if err != nil {
				t.Fatal(err)
			}
			rctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- relay.Run(rctx) }()
			t.Cleanup(func() {
				cancel()
				if err := <-done; err != nil {
					t.Errorf("relay: %v", err)
				}
			})
			msgs, err := h.pub.Consume(sink, "", true, false, false, false, nil)
			if err != nil {
				t.Fatal(err)
			}
			var msg amqp.Delivery
			select {
			case msg = <-msgs:
			case <-time.After(30 * time.Second):
				t.Fatal("the relay published nothing within 30s")
			}
			tpHeader, _ := msg.Headers["traceparent"].(string)
			msgSC := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(),
				propagation.MapCarrier{"traceparent": tpHeader}))
			publish := spanByID(t, rec, msgSC.SpanID())
			if publish.Name() != "amq.default publish" || publish.Parent().SpanID() != handler.SpanContext().SpanID() || msgSC.TraceID() != want {
				t.Errorf("published traceparent %q names span %q (parent %s) of trace %s; want the relay's publish span, child of the handler %s, in trace %s",
					tpHeader, publish.Name(), publish.Parent().SpanID(), msgSC.TraceID(), handler.SpanContext().SpanID(), want)
			}
		})
	}
}

// spanByID returns the ended span with id, waiting for it to end.
func spanByID(t *testing.T, rec *tracetest.SpanRecorder, id trace.SpanID) sdktrace.ReadOnlySpan {
	t.Helper()
	var span sdktrace.ReadOnlySpan
	consumertest.WaitFor(t, 10*time.Second, "span "+id.String()+" ended", func() bool {
		for _, s := range rec.Ended() {
			if s.SpanContext().SpanID() == id {
				span = s
				return true
			}
		}
		return false
	})
	return span
}
