package integration

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/internal/testenv"
	"go.opentelemetry.io/otel/propagation"
)

// BenchmarkTracingOverhead measures consumer throughput with tracing off
// (the no-op provider) and on (the SDK, always sampling, batch span
// processor, OTLP gRPC to the local Jaeger), in the same run. Each
// sub-benchmark pre-loads b.N messages with unique keys, then times one
// consumer (default concurrency 8) draining them; each handler inserts one
// row. It reports msgs/s from the first outcome to the last, and the CPU
// time of this process (consumer, SDK and exporter; not Postgres, RabbitMQ
// or Jaeger) per message; spans are flushed to Jaeger before the clock stops.
//
//	go test -run '^$' -bench TracingOverhead -benchtime 3000x ./integration/
func BenchmarkTracingOverhead(b *testing.B) {
	j := startJaeger(b)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	// Off and on alternate, overheadRounds times, so that both modes see the
	// same machine load.
	rounds := overheadRounds
	if v, err := strconv.Atoi(os.Getenv("IDEMQ_BENCH_ROUNDS")); err == nil && v > 0 {
		rounds = v
	}
	for range rounds {
		for _, mode := range []string{"off", "on"} {
			b.Run(mode, func(b *testing.B) { benchConsumer(b, j, mode == "on") })
		}
	}
}

// overheadRounds is how many times BenchmarkTracingOverhead runs each mode,
// unless IDEMQ_BENCH_ROUNDS says otherwise.
const overheadRounds = 3

// benchConsumer times one consumer draining b.N messages.
func benchConsumer(b *testing.B, j *jaeger, tracing bool) {
	b.StopTimer()
	e := testenv.New(b)
	var tp trace.TracerProvider = tracenoop.NewTracerProvider()
	flushSpans := func() {}
	if tracing {
		sdk := j.tracerProvider(b, "idemq-bench-"+testdb.RandomHex(4))
		tp, flushSpans = sdk, func() { flush(b, sdk) }
	}
	cfg, _ := e.ConsumerConfig("it.bench.trace", "bench")
	cfg.TracerProvider = tp
	var n atomic.Int64
	var first, last atomic.Int64
	done := make(chan struct{})
	cfg.OnOutcome = func(ev consumer.Event) {
		now := time.Now().UnixNano()
		if ev.Outcome != consumer.OutcomeProcessed {
			b.Errorf("outcome %s: %v", ev.Outcome, ev.Err)
		}
		first.CompareAndSwap(0, now)
		last.Store(now)
		if n.Add(1) == int64(b.N) {
			close(done)
		}
	}
	if _, err := e.Pool.Exec(context.Background(), "CREATE TABLE "+e.Schema+".ledger (key text PRIMARY KEY)"); err != nil {
		b.Fatal(err)
	}
	handler := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		_, err := tx.Exec(ctx, "INSERT INTO "+e.Schema+".ledger VALUES ($1)", d.Key)
		return consumer.Response{}, err
	}
	publishMany(b, e, cfg.Queue, b.N)

	start, cpu0 := time.Now(), cpuTime(b)
	b.StartTimer()
	e.Run(cfg, handler)
	select {
	case <-done:
	case <-time.After(time.Duration(b.N)*10*time.Millisecond + time.Minute):
		b.Fatalf("only %d of %d messages processed", n.Load(), b.N)
	}
	flushSpans()
	b.StopTimer()
	elapsed, cpu := time.Since(start), cpuTime(b)-cpu0
	steady := time.Duration(last.Load() - first.Load())
	if b.N > 1 && steady > 0 {
		b.ReportMetric(float64(b.N-1)/steady.Seconds(), "msgs/s")
	}
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s-with-startup")
	b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "cpu-µs/msg")
}

// cpuTime is the user and system CPU time of this process so far.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// publishMany loads n messages with unique keys into queue, waiting for
// the broker's confirms in windows of 1000.
func publishMany(b *testing.B, e *testenv.Env, queue string, n int) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var pending []*amqp.DeferredConfirmation
	wait := func() {
		for _, c := range pending {
			if ok, err := c.WaitContext(ctx); !ok || err != nil {
				b.Fatalf("publish not confirmed: %v", err)
			}
		}
		pending = pending[:0]
	}
	for i := range n {
		c, err := e.Pub.PublishWithDeferredConfirmWithContext(ctx, "", queue, false, false, amqp.Publishing{
			MessageId: fmt.Sprintf("bench-%d", i), Body: []byte(`{"amount":1}`), DeliveryMode: amqp.Persistent,
		})
		if err != nil {
			b.Fatal(err)
		}
		if pending = append(pending, c); len(pending) == 1000 {
			wait()
		}
	}
	wait()
}

// BenchmarkSpanCost isolates the CPU cost of tracing one delivery, without
// Postgres or RabbitMQ: the span tree the consumer makes for a processed
// message (process span with its attributes, reserve, handler, complete,
// W3C extraction from headers), with the no-op provider and with the SDK
// exporting over OTLP gRPC to the local Jaeger (batch span processor; the
// queue is flushed before the clock stops).
//
//	go test -run '^$' -bench SpanCost -benchmem ./integration/
func BenchmarkSpanCost(b *testing.B) {
	j := startJaeger(b)
	prop := propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	for _, mode := range []string{"off", "on"} {
		b.Run(mode, func(b *testing.B) {
			var tp trace.TracerProvider = tracenoop.NewTracerProvider()
			flushSpans := func() {}
			if mode == "on" {
				sdk := j.tracerProvider(b, "idemq-bench-spans-"+testdb.RandomHex(4))
				tp, flushSpans = sdk, func() { flush(b, sdk) }
			}
			tracer := tp.Tracer("github.com/idemq/idemq/consumer")
			headers := amqp.Table{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
			b.ReportAllocs()
			b.ResetTimer()
			cpu0 := cpuTime(b)
			for b.Loop() {
				ctx := prop.Extract(context.Background(), carrier(headers))
				ctx, span := tracer.Start(ctx, "orders process", trace.WithSpanKind(trace.SpanKindConsumer),
					trace.WithAttributes(
						attribute.String("messaging.system", "rabbitmq"),
						attribute.String("messaging.operation.type", "process"),
						attribute.String("messaging.destination.name", "orders"),
						attribute.String("messaging.rabbitmq.destination.routing_key", "orders"),
						attribute.String("idemq.consumer", "payments"),
						attribute.Int("messaging.message.body.size", 64),
						attribute.Int("idemq.attempt", 1),
					))
				span.SetAttributes(attribute.String("idemq.key_hash", "3683a2f26793"), attribute.String("idemq.tenant", ""))
				_, rs := tracer.Start(ctx, "idemq reserve")
				rs.SetAttributes(attribute.String("idemq.decision", "acquired"))
				rs.End()
				_, hs := tracer.Start(ctx, "idemq handler")
				hs.End()
				_, cs := tracer.Start(ctx, "idemq complete")
				cs.End()
				span.SetAttributes(attribute.String("idemq.outcome", "processed"))
				span.End()
			}
			flushSpans()
			b.ReportMetric(float64((cpuTime(b)-cpu0).Nanoseconds())/float64(b.N)/1e3, "cpu-µs/op")
		})
	}
}
