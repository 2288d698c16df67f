package outbox_test

import (
	"context"
	"errors"
	"math"
	"reflect"
	"regexp"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/claim"
	"github.com/idemq/idemq/internal/fieldtable"
	"github.com/idemq/idemq/outbox"
)

func TestMessageIDFromClaim(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	ctx := context.Background()
	c := dedup.Scope{Consumer: "payments", Tenant: "t1", Key: "charge-1"}
	// What the consumer runtime does before it runs a handler.
	underClaim := func() context.Context {
		return outbox.NewContext(claim.With(ctx, c), e.ob)
	}

	enqueueUnder := func(ctx context.Context) []string {
		var ids []string
		err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
			if err := outbox.Enqueue(ctx, tx, outbox.Message{RoutingKey: "a", Body: []byte("1")}); err != nil {
				return err
			}
			if err := outbox.Enqueue(ctx, tx, outbox.Message{RoutingKey: "a", Body: []byte("x"), MessageID: "explicit"}); err != nil {
				return err
			}
			if err := outbox.EnqueueBatch(ctx, tx, []outbox.Message{{RoutingKey: "a"}, {RoutingKey: "a"}}); err != nil {
				return err
			}
			rows, err := tx.Query(ctx, "SELECT message_id FROM "+e.schema+".outbox ORDER BY id DESC LIMIT 4")
			if err != nil {
				return err
			}
			ids, err = pgx.CollectRows(rows, pgx.RowTo[string])
			return err
		})
		if err != nil {
			t.Fatalf("enqueue: %v", err)
		}
		return []string{ids[3], ids[2], ids[1], ids[0]}
	}

	first := enqueueUnder(underClaim())
	want := []string{outbox.MessageID(c, "", 1), "explicit", outbox.MessageID(c, "", 2), outbox.MessageID(c, "", 3)}
	if !reflect.DeepEqual(first, want) {
		t.Fatalf("message ids = %v, want %v", first, want)
	}
	if !regexp.MustCompile(`^idemq-[0-9a-f]{32}$`).MatchString(first[0]) {
		t.Fatalf("message id %q: want idemq- and 32 hex digits", first[0])
	}
	// A retry of the operation (a fresh claim) produces the same ids.
	if again := enqueueUnder(underClaim()); !reflect.DeepEqual(again, first) {
		t.Fatalf("retry message ids = %v, want %v", again, first)
	}
	// Another tenant, key or step gives other ids.
	for _, other := range []struct {
		sc   dedup.Scope
		step string
	}{
		{dedup.Scope{Consumer: "payments", Tenant: "t2", Key: "charge-1"}, ""},
		{dedup.Scope{Consumer: "payments", Tenant: "t1", Key: "charge-2"}, ""},
		{c, "s"},
	} {
		if outbox.MessageID(other.sc, other.step, 1) == first[0] {
			t.Fatalf("scope %+v, step %q shares message id %s", other.sc, other.step, first[0])
		}
	}
	stepCtx := outbox.WithStep(underClaim(), "capture")
	if got, step, ok := outbox.ScopeFrom(stepCtx); !ok || step != "capture" || got != c {
		t.Fatalf("scope in step context = %+v, %q, %v", got, step, ok)
	}
	if step := enqueueUnder(stepCtx); step[0] != outbox.MessageID(c, "capture", 1) {
		t.Fatalf("step message id = %s", step[0])
	}
}

func TestEnqueueWithoutClaim(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	ctx := context.Background()
	if _, _, ok := outbox.ScopeFrom(ctx); ok {
		t.Fatal("claim in a bare context")
	}
	var id string
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		if err := e.ob.Enqueue(ctx, tx, outbox.Message{RoutingKey: "q"}); err != nil {
			return err
		}
		return tx.QueryRow(ctx, "SELECT message_id FROM "+e.schema+".outbox").Scan(&id)
	})
	if err != nil {
		t.Fatalf("enqueue: %v", err)
	}
	if !regexp.MustCompile(`^[0-9a-f-]{36}$`).MatchString(id) {
		t.Fatalf("message id without claim = %q, want a UUID", id)
	}

	// Bad input fails before anything is written, and a rolled back
	// transaction leaves no row.
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.ob.Enqueue(ctx, tx, outbox.Message{Headers: amqp.Table{"bad": struct{}{}}}); err == nil {
		t.Fatal("enqueue with an unsupported header type succeeded")
	}
	if err := e.ob.Enqueue(ctx, tx, outbox.Message{DeliveryMode: 7}); err == nil {
		t.Fatal("enqueue with delivery mode 7 succeeded")
	}
	if err := e.ob.Enqueue(ctx, tx, outbox.Message{Expiration: "1s"}); err == nil {
		t.Fatal("enqueue with expiration 1s succeeded")
	}
	if err := e.ob.Enqueue(ctx, tx, outbox.Message{Headers: amqp.Table{"t": amqp.Table{"f": []any{math.NaN()}}}}); err == nil {
		t.Fatal("enqueue with a NaN header succeeded")
	}
	if err := e.ob.Enqueue(ctx, tx, outbox.Message{RoutingKey: "q"}); err != nil {
		t.Fatal(err)
	}
	_ = tx.Rollback(ctx)
	if b := e.backlog(t); b.Pending != 1 {
		t.Fatalf("pending = %d after a rollback, want 1", b.Pending)
	}
	// COPY writes the same columns as INSERT.
	err = pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		return e.ob.EnqueueBatch(ctx, tx, []outbox.Message{{RoutingKey: "q", MessageID: "copied", Headers: amqp.Table{"n": int64(7), "b": []byte("x")}, OrderingKey: "k"}})
	})
	if err != nil {
		t.Fatal(err)
	}
	var stored []byte
	var orderingKey string
	if err := e.pool.QueryRow(ctx, "SELECT headers_amqp, ordering_key FROM "+e.schema+".outbox WHERE message_id = 'copied'").Scan(&stored, &orderingKey); err != nil {
		t.Fatal(err)
	}
	headers, err := fieldtable.Decode(stored)
	if err != nil || !reflect.DeepEqual(headers, amqp.Table{"n": int64(7), "b": []byte("x")}) || orderingKey != "k" {
		t.Fatalf("copied row: headers %#v (%v), ordering key %q", headers, err, orderingKey)
	}
	if err := e.ob.Enqueue(ctx, nil, outbox.Message{}); err == nil {
		t.Fatal("enqueue without a transaction succeeded")
	}
	if _, err := outbox.New(e.pool, &outbox.Config{Schema: "Bad-Schema"}); err == nil {
		t.Fatal("new with a bad schema succeeded")
	}
	if _, err := outbox.New(nil, nil); err == nil {
		t.Fatal("new without a pool succeeded")
	}
}

// A message keeps its properties and typed headers through the table and
// the broker, and its publish span continues the trace of the transaction
// that enqueued it.
func TestRelayPublishesPropertiesHeadersAndTrace(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	ctx := context.Background()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })

	headers := amqp.Table{
		"bool": true, "u8": uint8(200), "i8": int8(-3), "i16": int16(-300), "i32": int32(-70000),
		"i64": int64(math.MaxInt64), "u16": uint16(65000), "u32": uint32(4000000000),
		"f32": float32(1.5), "f64": 0.1, "dec": amqp.Decimal{Scale: 2, Value: 12345},
		"str": "héllo", "bytes": []byte{0, 1, 255}, "ts": time.Unix(1700000000, 0),
		"arr": []any{"a", int32(1), []any{false}}, "tab": amqp.Table{"inner": int64(-1)}, "nil": nil,
		"int": 42,
	}
	parentCtx, parent := tp.Tracer("test").Start(ctx, "handler")
	err := pgx.BeginFunc(parentCtx, e.pool, func(tx pgx.Tx) error {
		return e.ob.Enqueue(parentCtx, tx, outbox.Message{
			Exchange: e.exchange, RoutingKey: boundKey, Headers: headers, Body: []byte(`{"ok":true}`),
			ContentType: "application/json", ContentEncoding: "identity", MessageID: "m-1",
			CorrelationID: "c-1", ReplyTo: "r", Type: "payment.captured", AppID: "idemq-test", Priority: 3,
		})
	})
	parent.End()
	if err != nil {
		t.Fatalf("enqueue: %v", err)
	}
	cfg := e.relayConfig(t)
	cfg.TracerProvider = tp
	e.startRelay(t, cfg)
	_, got := e.consumeAll(t, 1, 20*time.Second)
	d := got[0]

	if d.MessageId != "m-1" || d.ContentType != "application/json" || d.ContentEncoding != "identity" ||
		d.CorrelationId != "c-1" || d.ReplyTo != "r" || d.Type != "payment.captured" || d.AppId != "idemq-test" ||
		d.Priority != 3 || d.DeliveryMode != amqp.Persistent || string(d.Body) != `{"ok":true}` {
		t.Fatalf("delivery properties = %+v", d)
	}
	want := amqp.Table{}
	for k, v := range headers {
		want[k] = v
	}
	want["int"] = int32(42) // what the wire carries for a Go int
	want["ts"] = time.Unix(1700000000, 0)
	traceparent, _ := d.Headers["traceparent"].(string)
	delete(d.Headers, "traceparent")
	delete(d.Headers, "tracestate")
	if ts, ok := d.Headers["ts"].(time.Time); ok && ts.Equal(want["ts"].(time.Time)) {
		d.Headers["ts"] = want["ts"]
	}
	if !reflect.DeepEqual(d.Headers, want) {
		t.Fatalf("headers:\n got %#v\nwant %#v", d.Headers, want)
	}

	var span sdktrace.ReadOnlySpan
	waitFor(t, 10*time.Second, "the publish span", func() bool {
		for _, s := range rec.Ended() {
			if s.SpanKind() == trace.SpanKindProducer {
				span = s
				return true
			}
		}
		return false
	})
	if span.Name() != e.exchange+" publish" {
		t.Errorf("span name %q", span.Name())
	}
	if span.Parent().SpanID() != parent.SpanContext().SpanID() || span.SpanContext().TraceID() != parent.SpanContext().TraceID() {
		t.Errorf("publish span parent = %v, want the enqueueing span %v", span.Parent(), parent.SpanContext())
	}
	attrs := map[string]string{}
	for _, a := range span.Attributes() {
		attrs[string(a.Key)] = a.Value.String()
	}
	if attrs["messaging.system"] != "rabbitmq" || attrs["messaging.destination.name"] != e.exchange || attrs["messaging.message.id"] != "m-1" {
		t.Errorf("span attributes = %v", attrs)
	}
	published := propagation.TraceContext{}.Extract(ctx, propagation.MapCarrier{"traceparent": traceparent})
	if sc := trace.SpanContextFromContext(published); sc.SpanID() != span.SpanContext().SpanID() {
		t.Errorf("published traceparent %q does not name the publish span %s", traceparent, span.SpanContext().SpanID())
	}
}

func TestRelayConfigValidation(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	for _, cfg := range []*outbox.RelayConfig{
		{BatchSize: -1},
		{RetryInitial: time.Minute, RetryMax: time.Second},
		{PollInterval: -time.Second},
		{MaxBatchBytes: -1},
	} {
		if _, err := outbox.NewRelay(e.ob, "amqp://guest:guest@127.0.0.1:5672/", cfg); err == nil {
			t.Errorf("config %+v accepted", cfg)
		}
	}
	if _, err := outbox.NewRelay(e.ob, "", nil); err == nil {
		t.Error("relay without a URL accepted")
	}
	_, err := outbox.NewRelay(e.ob, "amqp://user:s3cret@[bad", nil)
	if err == nil {
		t.Fatal("malformed URL accepted")
	}
	if regexp.MustCompile("s3cret").MatchString(err.Error()) {
		t.Fatalf("error leaks the password: %v", err)
	}
	r, err := outbox.NewRelay(e.ob, "amqp://guest:guest@127.0.0.1:5672/", nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := r.Config().MaxBatchBytes; got != outbox.DefaultMaxBatchBytes {
		t.Fatalf("default max batch bytes %d, want %d", got, outbox.DefaultMaxBatchBytes)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := r.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
		t.Fatalf("run on a cancelled context: %v", err)
	}
}

// The relay's counters and backlog gauges reach the configured meter.
func TestRelayMetrics(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	cfg := e.relayConfig(t)
	cfg.MeterProvider = mp
	e.startRelay(t, cfg)
	e.enqueueRows(t, 5, 1, 5, 0)
	e.consumeAll(t, 5, 20*time.Second)

	values := map[string]float64{}
	waitFor(t, 10*time.Second, "published=5 and pending=0 in the metrics", func() bool {
		var rm metricdata.ResourceMetrics
		if err := reader.Collect(context.Background(), &rm); err != nil {
			t.Fatal(err)
		}
		for _, sm := range rm.ScopeMetrics {
			if sm.Scope.Name != "github.com/idemq/idemq/outbox" {
				continue
			}
			for _, m := range sm.Metrics {
				switch d := m.Data.(type) {
				case metricdata.Sum[int64]:
					for _, p := range d.DataPoints {
						values[m.Name] = float64(p.Value)
					}
				case metricdata.Gauge[int64]:
					for _, p := range d.DataPoints {
						values[m.Name] = float64(p.Value)
					}
				case metricdata.Histogram[float64]:
					for _, p := range d.DataPoints {
						values[m.Name] = float64(p.Count)
					}
				}
			}
		}
		_, hasPending := values["idemq.outbox.pending"]
		return values["idemq.outbox.published"] == 5 && hasPending && values["idemq.outbox.pending"] == 0
	})
	if values["idemq.outbox.lag"] != 5 {
		t.Fatalf("lag histogram count = %v, want 5 (metrics %v)", values["idemq.outbox.lag"], values)
	}
}
