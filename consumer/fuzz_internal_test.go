package consumer

import (
	"context"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/internal/msgspan"
)

// FuzzTraceContext feeds the W3C trace context extraction of a delivery's
// headers with whatever a publisher may write. The seed corpus is in
// testdata/fuzz and runs with every go test.
func FuzzTraceContext(f *testing.F) {
	f.Add([]byte("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"), []byte("congo=t61rcWkgMzE"), uint8(0))
	f.Add([]byte("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"), []byte(""), uint8(1))
	f.Add([]byte("00-00000000000000000000000000000000-00f067aa0ba902b7-01"), []byte(""), uint8(0))
	f.Add([]byte("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"), []byte(""), uint8(0))
	f.Add([]byte("01-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01-extra"), []byte("a=1,,b=2"), uint8(0))
	f.Add([]byte("\xff\xfe"), []byte("\x00"), uint8(1))
	f.Add([]byte(nil), []byte(nil), uint8(2))
	prop := propagation.TraceContext{}
	f.Fuzz(func(t *testing.T, traceparent, tracestate []byte, kind uint8) {
		h := amqp.Table{}
		switch kind % 3 {
		case 0:
			h["traceparent"], h["tracestate"] = string(traceparent), string(tracestate)
		case 1:
			h["traceparent"], h["tracestate"] = traceparent, tracestate
		case 2:
			h["traceparent"], h["tracestate"] = int32(len(traceparent)), amqp.Table{"x": tracestate}
		}
		ctx := prop.Extract(context.Background(), msgspan.Headers(h))
		sc := trace.SpanContextFromContext(ctx)
		if !sc.IsValid() {
			return
		}
		if kind%3 == 2 {
			t.Fatalf("a valid span context from non-string headers: %v", sc)
		}
		tp := strings.ToLower(string(traceparent))
		if !strings.Contains(tp, sc.TraceID().String()) || !strings.Contains(tp, sc.SpanID().String()) {
			t.Fatalf("span context %s/%s is not the one of traceparent %q", sc.TraceID(), sc.SpanID(), traceparent)
		}
		// Injected again into a copy's headers, it reads back the same.
		out := amqp.Table{}
		prop.Inject(ctx, msgspan.Headers(out))
		back := trace.SpanContextFromContext(prop.Extract(context.Background(), msgspan.Headers(out)))
		if back.TraceID() != sc.TraceID() || back.SpanID() != sc.SpanID() || back.TraceFlags() != sc.TraceFlags() {
			t.Fatalf("round trip %v != %v", back, sc)
		}
		if err := out.Validate(); err != nil {
			t.Fatalf("injected headers are not a valid AMQP table: %v", err)
		}
	})
}
