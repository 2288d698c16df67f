package integration

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup/idemhttp"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/outbox"
	"go.opentelemetry.io/otel/propagation"
)

// jaegerWait bounds each wait for spans to show up in Jaeger after a flush.
const jaegerWait = 30 * time.Second

// TestTracing sends real spans to a real Jaeger and reads them back through
// its query API.
func TestTracing(t *testing.T) {
	j := startJaeger(t)
	// The consumer and the outbox read the global propagator, as the idemq
	// binary sets it (telemetry.Setup).
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))

	t.Run("duplicate links to the original processing", func(t *testing.T) {
		t.Parallel()
		testDuplicateLink(t, j)
	})
	t.Run("one trace across the outbox relay", func(t *testing.T) {
		t.Parallel()
		testTraceAcrossRelay(t, j)
	})
	t.Run("group commit links the group's spans to each delivery", func(t *testing.T) {
		t.Parallel()
		testGroupLinks(t, j)
	})
	t.Run("one trace from an HTTP client's retry to the worker", func(t *testing.T) {
		t.Parallel()
		testTraceFromHTTP(t, j)
	})
}

// testTraceFromHTTP follows one key from a client through the HTTP
// middleware, the outbox and the relay to a worker, in one trace; the
// client's retry, answered from the store, links to the request that
// processed the key.
func testTraceFromHTTP(t *testing.T, j *jaeger) {
	e := testenv.New(t)
	service := "idemq-it-http-" + testdb.RandomHex(4)
	tp := j.tracerProvider(t, service)
	prop := propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	cfg, events := e.ConsumerConfig("it.trace.http", "fulfilment")
	cfg.TracerProvider = tp
	e.Run(cfg, func(context.Context, pgx.Tx, *consumer.Delivery) (consumer.Response, error) {
		return consumer.Response{}, nil
	})
	ob, err := outbox.New(e.Pool, &outbox.Config{Schema: e.Schema, Propagator: prop})
	if err != nil {
		t.Fatal(err)
	}
	runTracedRelay(t, e, ob, tp, prop)
	mw, err := idemhttp.New(e.Store, &idemhttp.Config{Consumer: "orders-api", Outbox: ob, TracerProvider: tp, Propagator: prop, Logger: cfg.Logger})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw.Require(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := ob.Enqueue(r.Context(), idemhttp.Tx(r), outbox.Message{RoutingKey: cfg.Queue, Body: []byte(`{"order":1}`)}); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusAccepted)
	})))
	t.Cleanup(srv.Close)

	// The client's span starts the trace; it sends the request twice.
	ctx, client := tp.Tracer("integration").Start(context.Background(), "checkout POST", trace.WithSpanKind(trace.SpanKindClient))
	for i := range 2 {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"order":1}`))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set(idemhttp.DefaultHeader, "order-http-1")
		prop.Inject(ctx, propagation.HeaderCarrier(req.Header))
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusAccepted || (resp.Header.Get(idemhttp.ReplayedHeader) == "true") != (i == 1) {
			t.Fatalf("request %d: %s, replayed %q", i+1, resp.Status, resp.Header.Get(idemhttp.ReplayedHeader))
		}
	}
	client.End()
	rootTrace := client.SpanContext().TraceID().String()
	if ev := testenv.WaitOutcome(t, events, consumer.OutcomeProcessed); ev.TraceID != rootTrace {
		t.Fatalf("the worker's trace %s, want the client's %s", ev.TraceID, rootTrace)
	}
	flush(t, tp)

	processName, relayPublish := cfg.Queue+" process", "amq.default publish"
	tr := j.waitTrace(t, rootTrace, jaegerWait, func(tr jTrace) bool {
		return len(tr.byName("idemq request")) == 2 && len(tr.byName(relayPublish)) == 1 && len(tr.byName(processName)) == 1
	})
	spanByID := map[string]jSpan{}
	for _, s := range tr.Spans {
		spanByID[s.SpanID] = s
	}
	var first, retry jSpan
	for _, s := range tr.byName("idemq request") {
		switch outcome, _ := s.tag("idemq.outcome"); outcome {
		case "processed":
			first = s
		case "duplicate":
			retry = s
		}
	}
	if first.SpanID == "" || retry.SpanID == "" {
		t.Fatalf("request spans %+v: want one processed, one duplicate", tr.byName("idemq request"))
	}
	// The chain: client → request → relay publish → worker's process.
	if p := spanByID[first.parent()].OperationName; p != "checkout POST" {
		t.Errorf("parent of the request span is %q, want the client's span", p)
	}
	if p := spanByID[tr.byName(relayPublish)[0].parent()].SpanID; p != first.SpanID {
		t.Errorf("parent of the relay's publish is %q, want the request that enqueued it %s", spanByID[p].OperationName, first.SpanID)
	}
	if p := tr.byName(processName)[0].parent(); p != tr.byName(relayPublish)[0].SpanID {
		t.Errorf("parent of the worker's process span is %q, want the relay's publish", spanByID[p].OperationName)
	}
	// The retry links to the request that processed the key.
	if !slices.ContainsFunc(retry.References, func(r jRef) bool { return r.RefType == "FOLLOWS_FROM" && r.SpanID == first.SpanID }) {
		t.Errorf("the retry's references %+v, want FOLLOWS_FROM the processed request %s", retry.References, first.SpanID)
	}
}

func testDuplicateLink(t *testing.T, j *jaeger) {
	e := testenv.New(t)
	service := "idemq-it-dup-" + testdb.RandomHex(4)
	tp := j.tracerProvider(t, service)
	cfg, events := e.ConsumerConfig("it.trace.dup", "payments")
	cfg.TracerProvider = tp
	if _, err := e.Pool.Exec(context.Background(), "CREATE TABLE "+e.Schema+".ledger (key text)"); err != nil {
		t.Fatal(err)
	}
	e.Run(cfg, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		_, err := tx.Exec(ctx, "INSERT INTO "+e.Schema+".ledger VALUES ($1)", d.Key)
		return consumer.Response{Code: 201}, err
	})

	e.Publish(cfg.Queue, "pay-1", `{"amount":10}`, nil)
	orig := testenv.WaitOutcome(t, events, consumer.OutcomeProcessed)
	e.Publish(cfg.Queue, "pay-1", `{"amount":10}`, nil)
	dup := testenv.WaitOutcome(t, events, consumer.OutcomeDuplicate)
	if orig.TraceID == "" || dup.TraceID == "" || dup.TraceID == orig.TraceID {
		t.Fatalf("trace ids: original %q, duplicate %q; want two different traces", orig.TraceID, dup.TraceID)
	}
	if dup.OriginalTraceID != orig.TraceID {
		t.Fatalf("duplicate's original trace %q, want %q", dup.OriginalTraceID, orig.TraceID)
	}
	flush(t, tp)

	// The original: the process span and its children.
	processName := cfg.Queue + " process"
	want := []string{processName, "idemq reserve", "idemq handler", "idemq complete"}
	tr := j.waitTrace(t, orig.TraceID, jaegerWait, func(tr jTrace) bool {
		for _, op := range want {
			if len(tr.byName(op)) != 1 {
				return false
			}
		}
		return true
	})
	process := tr.byName(processName)[0]
	for key, val := range map[string]string{
		"idemq.outcome": "processed", "span.kind": "consumer", "messaging.system": "rabbitmq",
		"messaging.destination.name": cfg.Queue, "messaging.operation.type": "process",
		"idemq.consumer": "payments", "idemq.attempt": "1", "idemq.key_hash": orig.KeyHash,
	} {
		if got, _ := process.tag(key); got != val {
			t.Errorf("original process span: tag %s = %q, want %q", key, got, val)
		}
	}
	if _, ok := process.tag("idemq.key"); ok {
		t.Error("the raw key is a span attribute although LogKeys is off")
	}
	if p := process.parent(); p != "" {
		t.Errorf("original process span has parent %s; the publisher sent no traceparent", p)
	}
	for _, op := range want[1:] {
		if s := tr.byName(op)[0]; s.parent() != process.SpanID {
			t.Errorf("span %q: parent %q, want the process span %s", op, s.parent(), process.SpanID)
		}
	}
	if got, _ := tr.byName("idemq reserve")[0].tag("idemq.decision"); got != "acquired" {
		t.Errorf("reserve decision %q, want acquired", got)
	}
	if svc := tr.Processes[process.ProcessID].ServiceName; svc != service {
		t.Errorf("service %q, want %q", svc, service)
	}

	// The duplicate, found the way an operator finds it: by tag.
	found := j.waitFind(t, service, "", map[string]string{"idemq.outcome": "duplicate"}, jaegerWait,
		func(trs []jTrace) bool { return len(trs) == 1 })
	dtr := found[0]
	if !sameTraceID(dtr.TraceID, dup.TraceID) {
		t.Fatalf("tag search found trace %s, want the duplicate's %s", dtr.TraceID, dup.TraceID)
	}
	dprocess := dtr.byName(processName)
	if len(dprocess) != 1 {
		t.Fatalf("duplicate trace spans %q, want one %q", dtr.names(), processName)
	}
	var linked bool
	for _, r := range dprocess[0].References {
		if r.RefType == "FOLLOWS_FROM" && sameTraceID(r.TraceID, orig.TraceID) && r.SpanID == process.SpanID {
			linked = true
		}
	}
	if !linked {
		t.Errorf("duplicate's process span references %+v, want FOLLOWS_FROM %s/%s", dprocess[0].References, orig.TraceID, process.SpanID)
	}
	var event bool
	for _, l := range dprocess[0].Logs {
		name, _ := tagValue(l.Fields, "event")
		tid, _ := tagValue(l.Fields, "idemq.original.trace_id")
		if name == "idemq.duplicate_suppressed" && sameTraceID(tid, orig.TraceID) {
			event = true
		}
	}
	if !event {
		t.Errorf("duplicate's process span lacks the event idemq.duplicate_suppressed with the original trace id: %+v", dprocess[0].Logs)
	}
	if got := dtr.byName("idemq reserve"); len(got) == 1 {
		if d, _ := got[0].tag("idemq.decision"); d != "duplicate" {
			t.Errorf("duplicate's reserve decision %q, want duplicate", d)
		}
	} else {
		t.Errorf("duplicate trace spans %q, want one idemq reserve", dtr.names())
	}
	if n := len(dtr.byName("idemq handler")); n != 0 {
		t.Errorf("duplicate trace has %d handler spans: the handler saw a duplicate", n)
	}
}

func testTraceAcrossRelay(t *testing.T, j *jaeger) {
	e := testenv.New(t)
	service := "idemq-it-relay-" + testdb.RandomHex(4)
	tp := j.tracerProvider(t, service)
	prop := propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

	// Stage 1 forwards each order to queue B through the outbox; stage 2
	// consumes queue B.
	cfgA, eventsA := e.ConsumerConfig("it.trace.orders", "orders")
	cfgB, eventsB := e.ConsumerConfig("it.trace.shipping", "shipping")
	cfgA.TracerProvider, cfgB.TracerProvider = tp, tp
	ob, err := outbox.New(e.Pool, &outbox.Config{Schema: e.Schema, Propagator: prop})
	if err != nil {
		t.Fatal(err)
	}
	e.Run(cfgA, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		return consumer.Response{}, ob.Enqueue(ctx, tx, outbox.Message{RoutingKey: cfgB.Queue, Body: d.Body, MessageID: "ship-" + d.Key})
	})
	e.Run(cfgB, func(context.Context, pgx.Tx, *consumer.Delivery) (consumer.Response, error) {
		return consumer.Response{}, nil
	})
	runTracedRelay(t, e, ob, tp, prop)

	// The publisher's own span starts the trace.
	ctx, root := tp.Tracer("integration").Start(context.Background(), "checkout publish", trace.WithSpanKind(trace.SpanKindProducer))
	headers := amqp.Table{}
	prop.Inject(ctx, carrier(headers))
	e.Publish(cfgA.Queue, "order-1", `{"order":1}`, headers)
	root.End()
	rootTrace := root.SpanContext().TraceID().String()

	evA := testenv.WaitOutcome(t, eventsA, consumer.OutcomeProcessed)
	evB := testenv.WaitOutcome(t, eventsB, consumer.OutcomeProcessed)
	if evA.TraceID != rootTrace || evB.TraceID != rootTrace {
		t.Fatalf("traces: publisher %s, stage 1 %s, stage 2 %s; want one trace", rootTrace, evA.TraceID, evB.TraceID)
	}
	flush(t, tp)

	processA, processB, relayPublish := cfgA.Queue+" process", cfgB.Queue+" process", "amq.default publish"
	tr := j.waitTrace(t, rootTrace, jaegerWait, func(tr jTrace) bool {
		return len(tr.byName(processA)) == 1 && len(tr.byName(processB)) == 1 && len(tr.byName(relayPublish)) == 1 &&
			len(tr.byName("idemq handler")) == 2 && len(tr.byName("checkout publish")) == 1
	})
	spanByID := map[string]jSpan{}
	for _, s := range tr.Spans {
		spanByID[s.SpanID] = s
		if svc := tr.Processes[s.ProcessID].ServiceName; svc != service {
			t.Errorf("span %q of service %q, want %q", s.OperationName, svc, service)
		}
	}
	// The chain: publisher → stage 1 process → handler → relay publish → stage 2 process.
	parentName := func(op string) string {
		return spanByID[tr.byName(op)[0].parent()].OperationName
	}
	if got := parentName(processA); got != "checkout publish" {
		t.Errorf("parent of %q is %q, want the publisher's span", processA, got)
	}
	if got := parentName(relayPublish); got != "idemq handler" {
		t.Errorf("parent of the relay's %q is %q, want the stage 1 handler span that enqueued it", relayPublish, got)
	}
	if got := parentName(processB); got != relayPublish {
		t.Errorf("parent of %q is %q, want the relay's %q", processB, got, relayPublish)
	}
	rp := tr.byName(relayPublish)[0]
	if kind, _ := rp.tag("span.kind"); kind != "producer" {
		t.Errorf("relay publish span kind %q, want producer", kind)
	}
	if id, _ := rp.tag("messaging.message.id"); id != "ship-order-1" {
		t.Errorf("relay publish span message id %q, want ship-order-1", id)
	}
	handlerA := spanByID[rp.parent()]
	if handlerA.parent() != tr.byName(processA)[0].SpanID {
		t.Errorf("the handler that enqueued is not stage 1's: spans %q", tr.names())
	}
	if !slices.ContainsFunc(tr.Spans, func(s jSpan) bool {
		return s.OperationName == "idemq complete" && s.parent() == tr.byName(processB)[0].SpanID
	}) {
		t.Errorf("stage 2 has no complete span: spans %q", tr.names())
	}
}

// runTracedRelay runs a relay of ob for the test, tracing to tp with prop.
func runTracedRelay(t *testing.T, e *testenv.Env, ob *outbox.Outbox, tp trace.TracerProvider, prop propagation.TextMapPropagator) {
	t.Helper()
	relay, err := outbox.NewRelay(ob, testamqp.URL(), &outbox.RelayConfig{
		TracerProvider: tp, Propagator: prop, PollInterval: 100 * time.Millisecond,
		ConnectionName: "idemq-test-relay-" + e.Schema, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	e.RunFunc(relay.Run)
}

// carrier adapts amqp.Table to propagation.TextMapCarrier for the test's publisher.
type carrier amqp.Table

func (c carrier) Get(key string) string {
	s, _ := c[key].(string)
	return s
}
func (c carrier) Set(key, value string) { c[key] = value }
func (c carrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

func testGroupLinks(t *testing.T, j *jaeger) {
	e := testenv.New(t)
	service := "idemq-it-group-" + testdb.RandomHex(4)
	tp := j.tracerProvider(t, service)
	cfg, events := e.ConsumerConfig("it.trace.group", "grouped")
	cfg.TracerProvider = tp
	// One worker finds the three messages waiting: one group.
	cfg.Concurrency, cfg.Group.Size, cfg.Group.Linger = 1, 3, 5*time.Second
	for i := range 3 {
		e.Publish(cfg.Queue, fmt.Sprintf("g-%d", i), `{}`, nil)
	}
	e.Run(cfg, func(context.Context, pgx.Tx, *consumer.Delivery) (consumer.Response, error) {
		return consumer.Response{}, nil
	})
	traces := map[string]bool{}
	for range 3 {
		traces[testenv.WaitOutcome(t, events, consumer.OutcomeProcessed).TraceID] = true
	}
	if len(traces) != 3 {
		t.Fatalf("deliveries share traces: %v", traces)
	}
	flush(t, tp)

	// Each delivery keeps its own trace: process span, its handler span.
	processSpans := map[string]string{} // trace id -> process span id
	for id := range traces {
		tr := j.waitTrace(t, id, jaegerWait, func(tr jTrace) bool {
			return len(tr.byName(cfg.Queue+" process")) == 1 && len(tr.byName("idemq handler")) == 1
		})
		processSpans[strings.ToLower(id)] = tr.byName(cfg.Queue + " process")[0].SpanID
	}
	// The group's commit is a span of its own, linked to the three.
	found := j.waitFind(t, service, "idemq commit group", nil, jaegerWait, func(trs []jTrace) bool { return len(trs) == 1 })
	for _, tr := range found {
		for _, s := range tr.byName("idemq commit group") {
			linked := map[string]bool{}
			for _, r := range s.References {
				if r.RefType == "FOLLOWS_FROM" && processSpans[strings.ToLower(r.TraceID)] == r.SpanID {
					linked[r.TraceID] = true
				}
			}
			if len(linked) != 3 {
				t.Errorf("idemq commit group references %+v, want the 3 process spans %v", s.References, processSpans)
			}
		}
	}
}
