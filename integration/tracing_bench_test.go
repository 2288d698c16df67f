package integration

import (
	"context"
	"fmt"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/telemetry"
	"github.com/idemq/idemq/internal/testdb"
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
	otel.SetTextMapPropagator(telemetry.Propagator())
	// Off and on alternate, overheadRounds times, so that both modes see the
	// same machine load.
	for range overheadRounds {
		for _, mode := range []string{"off", "on"} {
			b.Run(mode, func(b *testing.B) { benchConsumer(b, j, mode == "on") })
		}
	}
}

// overheadRounds is how many times BenchmarkTracingOverhead runs each mode.
const overheadRounds = 3

// benchConsumer times one consumer draining b.N messages.
func benchConsumer(b *testing.B, j *jaeger, tracing bool) {
	b.StopTimer()
	e := newEnv(b)
	var tp trace.TracerProvider = tracenoop.NewTracerProvider()
	flushSpans := func() {}
	if tracing {
		sdk := j.tracerProvider(b, "idemq-bench-"+testdb.RandomHex(4))
		tp, flushSpans = sdk, func() { flush(b, sdk) }
	}
	cfg, _ := e.consumerConfig("it.bench.trace", "bench")
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
	if _, err := e.pool.Exec(context.Background(), "CREATE TABLE "+e.schema+".ledger (key text PRIMARY KEY)"); err != nil {
		b.Fatal(err)
	}
	handler := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		_, err := tx.Exec(ctx, "INSERT INTO "+e.schema+".ledger VALUES ($1)", d.Key)
		return consumer.Response{}, err
	}
	publishMany(b, e, cfg.Queue, b.N)

	start, cpu0 := time.Now(), cpuTime(b)
	b.StartTimer()
	e.run(cfg, handler)
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
func publishMany(b *testing.B, e *env, queue string, n int) {
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
		c, err := e.pub.PublishWithDeferredConfirmWithContext(ctx, "", queue, false, false, amqp.Publishing{
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
