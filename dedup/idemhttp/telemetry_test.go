package idemhttp_test

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemq/idemq/dedup/idemhttp"
)

// Every guarded request gets a span with its outcome and is counted by
// outcome; the replayed duplicate's span links to the span of the request
// that processed the key, as a suppressed message's does.
func TestRequestSpansAndCounter(t *testing.T) {
	t.Parallel()
	spans := tracetest.NewSpanRecorder()
	endings := make(chan struct{}, 16)
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans), sdktrace.WithSpanProcessor(onEnd(endings)))
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	a := newAPI(t, idemhttp.Config{TracerProvider: tp, MeterProvider: mp}, nil)

	for _, c := range []struct {
		key, body string
		status    int
		replayed  bool
	}{
		{"order-1", `{"amount":5}`, http.StatusCreated, false},
		{"order-1", `{"amount":5}`, http.StatusCreated, true},
		{"order-2", `{"amount":20000}`, http.StatusPaymentRequired, false},
		{"order-3", `{"amount":0}`, http.StatusBadRequest, false},
		{"", `{"amount":5}`, http.StatusBadRequest, false},
	} {
		if r := a.do("POST", "/orders", c.key, c.body); r.status != c.status || r.replayed() != c.replayed {
			t.Fatalf("%s %s: %d replayed %v, want %d replayed %v", c.key, c.body, r.status, r.replayed(), c.status, c.replayed)
		}
	}
	// A span ends after its response is written: wait for all five.
	timeout := time.After(10 * time.Second)
	for n := 0; n < 5; n++ {
		select {
		case <-endings:
		case <-timeout:
			t.Fatalf("%d spans ended, want 5", n)
		}
	}
	ended := spans.Ended()
	want := []string{"processed", "duplicate", "rejected", "not_stored", "invalid_key"}
	for i, s := range ended {
		if s.Name() != "idemq request" {
			t.Fatalf("span %d is %q", i, s.Name())
		}
		attrs := map[attribute.Key]attribute.Value{}
		for _, kv := range s.Attributes() {
			attrs[kv.Key] = kv.Value
			if strings.Contains(kv.Value.Emit(), "order-") {
				t.Errorf("span %d names the raw key in %s", i, kv.Key)
			}
		}
		if got := attrs["idemq.outcome"].AsString(); got != want[i] {
			t.Errorf("span %d: outcome %q, want %q", i, got, want[i])
		}
		if i < 4 && attrs["idemq.key_hash"].AsString() == "" {
			t.Errorf("span %d has no idemq.key_hash", i)
		}
	}
	if got := ended[4].Attributes(); !hasAttr(got, "idemq.reason", idemhttp.CodeKeyRequired) {
		t.Errorf("the keyless request's span: %v, want idemq.reason %s", got, idemhttp.CodeKeyRequired)
	}
	dup, first := ended[1], ended[0]
	links := dup.Links()
	if len(links) != 1 || links[0].SpanContext.SpanID() != first.SpanContext().SpanID() || links[0].SpanContext.TraceID() != first.SpanContext().TraceID() ||
		!hasAttr(links[0].Attributes, "idemq.link", "duplicate_of") {
		t.Fatalf("the duplicate's links %+v, want one to the first request's span %s", links, first.SpanContext().SpanID())
	}
	if ev := dup.Events(); len(ev) != 1 || ev[0].Name != "idemq.duplicate_suppressed" {
		t.Fatalf("the duplicate's events %+v", ev)
	}

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	counts := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "idemq.http.requests" {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				o, _ := dp.Attributes.Value("outcome")
				counts[o.AsString()] += dp.Value
			}
		}
	}
	for _, o := range want {
		if counts[o] != 1 {
			t.Errorf("idemq.http.requests %v, want 1 of each of %v", counts, want)
			break
		}
	}
}

// onEnd is a span processor that signals every span's end on c.
type onEnd chan<- struct{}

func (c onEnd) OnStart(context.Context, sdktrace.ReadWriteSpan) {}
func (c onEnd) OnEnd(sdktrace.ReadOnlySpan)                     { c <- struct{}{} }
func (c onEnd) Shutdown(context.Context) error                  { return nil }
func (c onEnd) ForceFlush(context.Context) error                { return nil }

func hasAttr(attrs []attribute.KeyValue, key, value string) bool {
	for _, kv := range attrs {
		if string(kv.Key) == key && kv.Value.AsString() == value {
			return true
		}
	}
	return false
}

// A server without tracing of its own (idemq gateway) continues the trace
// of the client's traceparent: the request's span, and so the handler's
// outbox messages and the workers after them, are in the client's trace.
func TestRequestSpanContinuesTheClientsTrace(t *testing.T) {
	t.Parallel()
	spans := tracetest.NewSpanRecorder()
	endings := make(chan struct{}, 4)
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans), sdktrace.WithSpanProcessor(onEnd(endings)))
	a := newAPI(t, idemhttp.Config{TracerProvider: tp}, nil)
	const traceID, parentID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	if r := a.do("POST", "/orders", "traced-1", `{"amount":5}`, "traceparent", "00-"+traceID+"-"+parentID+"-01"); r.status != http.StatusCreated {
		t.Fatalf("status %d", r.status)
	}
	select {
	case <-endings:
	case <-time.After(10 * time.Second):
		t.Fatal("no span ended")
	}
	s := spans.Ended()[0]
	if s.SpanContext().TraceID().String() != traceID || s.Parent().SpanID().String() != parentID || !s.Parent().IsRemote() {
		t.Fatalf("span in trace %s under %s (remote %v), want trace %s under the client's %s",
			s.SpanContext().TraceID(), s.Parent().SpanID(), s.Parent().IsRemote(), traceID, parentID)
	}
}
