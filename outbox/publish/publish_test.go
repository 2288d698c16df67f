package publish_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/outbox/publish"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// newPublisher returns a publisher of the test whose connections are named
// after it (for CloseConnections), closed when the test ends.
func newPublisher(tb testing.TB, cfg publish.Config) (*publish.Publisher, string) {
	tb.Helper()
	name := "idemq-test-pub-" + testdb.RandomHex(5)
	cfg.ConnectionName = name
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	p, err := publish.New(testamqp.URL(), &cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = p.Close() })
	return p, name
}

// declareQueue declares a quorum queue of the test, deleted when it ends.
func declareQueue(tb testing.TB, ch *amqp.Channel, args amqp.Table) string {
	tb.Helper()
	q := testamqp.Name(tb, "pubtest")
	if args == nil {
		args = amqp.Table{"x-queue-type": "quorum"}
	}
	if _, err := ch.QueueDeclare(q, true, false, false, false, args); err != nil {
		tb.Fatal(err)
	}
	testamqp.DeleteQueuesAtCleanup(tb, []string{q}, nil)
	return q
}

func get(tb testing.TB, ch *amqp.Channel, queue string) amqp.Delivery {
	tb.Helper()
	var d amqp.Delivery
	consumertest.WaitFor(tb, 10*time.Second, "a message in "+queue, func() bool {
		var ok bool
		var err error
		d, ok, err = ch.Get(queue, true)
		if err != nil {
			tb.Fatal(err)
		}
		return ok
	})
	return d
}

func TestPublishSetsMessageID(t *testing.T) {
	t.Parallel()
	ch := testamqp.Channel(t, testamqp.Dial(t))
	q := declareQueue(t, ch, nil)
	p, _ := newPublisher(t, publish.Config{})
	headers := amqp.Table{"x-tenant-id": "acme"}
	key := publish.NewKey()
	err := p.Publish(t.Context(), key, publish.Message{
		RoutingKey: q, Headers: headers, Body: []byte("hello"),
		ContentType: "text/plain", CorrelationID: "c-1", Type: "greeting",
	})
	if err != nil {
		t.Fatal(err)
	}
	d := get(t, ch, q)
	delete(d.Headers, "x-delivery-count") // the quorum queue's own
	if d.MessageId != key {
		t.Errorf("message_id %q, want the key %q", d.MessageId, key)
	}
	if d.DeliveryMode != amqp.Persistent {
		t.Errorf("delivery mode %d, want persistent", d.DeliveryMode)
	}
	if string(d.Body) != "hello" || d.ContentType != "text/plain" || d.CorrelationId != "c-1" || d.Type != "greeting" {
		t.Errorf("got body %q, content type %q, correlation id %q, type %q", d.Body, d.ContentType, d.CorrelationId, d.Type)
	}
	if diff := testamqp.HeadersDiff(d.Headers, headers); diff != "" {
		t.Errorf("headers:%s", diff)
	}
}

func TestPublishUnroutable(t *testing.T) {
	t.Parallel()
	ch := testamqp.Channel(t, testamqp.Dial(t))
	q := declareQueue(t, ch, nil)
	p, _ := newPublisher(t, publish.Config{})
	for _, tc := range []struct{ name, exchange, routingKey string }{
		{"no binding", "amq.direct", "idemq.no-such-binding"},
		{"no queue", "", "idemq.no-such-queue." + testdb.RandomHex(4)},
		{"no exchange", "idemq.no-such-exchange." + testdb.RandomHex(4), "k"},
	} {
		err := p.Publish(t.Context(), publish.NewKey(), publish.Message{Exchange: tc.exchange, RoutingKey: tc.routingKey, Body: []byte("x")})
		if !errors.Is(err, publish.ErrUnroutable) {
			t.Errorf("%s: err %v, want ErrUnroutable", tc.name, err)
		}
	}
	// The publisher still works: an unroutable message does not break it.
	if err := p.Publish(t.Context(), publish.NewKey(), publish.Message{RoutingKey: q, Body: []byte("x")}); err != nil {
		t.Fatalf("routable publish after unroutable ones: %v", err)
	}
	get(t, ch, q)
}

func TestPublishRefusesInvalidKeys(t *testing.T) {
	t.Parallel()
	p, _ := newPublisher(t, publish.Config{})
	for _, tc := range []struct {
		key  string
		want error
	}{
		{"", dedup.ErrKeyRequired},
		{"a\x00b", dedup.ErrKeyInvalid},
		{strings.Repeat("k", dedup.MaxKeyLen+1), dedup.ErrKeyInvalid},
		{"\xff", dedup.ErrKeyInvalid},
	} {
		err := p.Publish(t.Context(), tc.key, publish.Message{RoutingKey: "q"})
		if !errors.Is(err, tc.want) {
			t.Errorf("key %q: err %v, want %v", tc.key, err, tc.want)
		}
	}
}

func TestNewKey(t *testing.T) {
	t.Parallel()
	seen := map[string]bool{}
	for range 1000 {
		k := publish.NewKey()
		if err := dedup.ValidateKey(k); err != nil {
			t.Fatalf("NewKey gave an invalid key: %v", err)
		}
		if len(k) != 36 || seen[k] {
			t.Fatalf("key %q: want 36 characters, each key new", k)
		}
		seen[k] = true
	}
}

func TestNewRefusesMalformedURLWithoutQuotingIt(t *testing.T) {
	t.Parallel()
	_, err := publish.New("amqp://user:s3cret@host:port:bad/", nil)
	if err == nil || strings.Contains(err.Error(), "s3cret") {
		t.Fatalf("err %v: want an error that does not quote the URL", err)
	}
}

// TestPublishContextEndsRetries: with the broker unreachable, Publish
// retries until its context ends, then returns the context's error with the
// last attempt's, and no credentials.
func TestPublishContextEndsRetries(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now: every dial is refused
	var attempts atomic.Int32
	log := slog.New(handlerFunc(func(r slog.Record) {
		if r.Level == slog.LevelWarn {
			attempts.Add(1)
		}
	}))
	p, err := publish.New("amqp://user:s3cret@"+addr+"/", &publish.Config{Logger: log, RetryInitial: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
	defer cancel()
	start := time.Now()
	err = p.Publish(ctx, "k-1", publish.Message{RoutingKey: "q"})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err %v, want the context's deadline", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("Publish returned %s after its context ended", took)
	}
	if strings.Contains(err.Error(), "s3cret") {
		t.Errorf("the error quotes the credentials: %v", err)
	}
	if n := attempts.Load(); n < 2 {
		t.Errorf("%d failed attempts logged, want retries", n)
	}

	// Cancelling stops the retries as well.
	ctx, cancel = context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- p.Publish(ctx, "k-2", publish.Message{RoutingKey: "q"}) }()
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("err %v, want context.Canceled", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Publish kept retrying after its context was cancelled")
	}
}

// TestPublishRetriesNack: a full queue (x-overflow reject-publish; a classic
// queue, whose limit is exact) nacks;
// Publish retries, with the same message id, until there is room.
func TestPublishRetriesNack(t *testing.T) {
	t.Parallel()
	ch := testamqp.Channel(t, testamqp.Dial(t))
	q := declareQueue(t, ch, amqp.Table{"x-queue-type": "classic", "x-max-length": 1, "x-overflow": "reject-publish"})
	testamqp.Publish(t, ch, "", q, amqp.Publishing{MessageId: "filler", Body: []byte("full")})
	nacked := make(chan struct{})
	var once sync.Once
	log := slog.New(handlerFunc(func(r slog.Record) {
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "err" && strings.Contains(a.Value.String(), publish.ErrNacked.Error()) {
				once.Do(func() { close(nacked) })
			}
			return true
		})
	}))
	p, _ := newPublisher(t, publish.Config{Logger: log, RetryInitial: 20 * time.Millisecond, RetryMax: 100 * time.Millisecond})
	key := publish.NewKey()
	done := make(chan error, 1)
	go func() { done <- p.Publish(t.Context(), key, publish.Message{RoutingKey: q, Body: []byte("mine")}) }()
	select {
	case <-nacked:
	case err := <-done:
		t.Fatalf("Publish returned %v before being nacked", err)
	case <-time.After(30 * time.Second):
		t.Fatal("no nack within 30s")
	}
	if d := get(t, ch, q); d.MessageId != "filler" {
		t.Fatalf("first message %q, want the filler", d.MessageId)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Publish after room was made: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Publish did not succeed within 30s of room being made")
	}
	if d := get(t, ch, q); d.MessageId != key {
		t.Fatalf("message_id %q, want the key", d.MessageId)
	}
}

// handlerFunc is a slog.Handler that hands every record to a function.
type handlerFunc func(slog.Record)

func (h handlerFunc) Enabled(context.Context, slog.Level) bool      { return true }
func (h handlerFunc) Handle(_ context.Context, r slog.Record) error { h(r); return nil }
func (h handlerFunc) WithAttrs([]slog.Attr) slog.Handler            { return h }
func (h handlerFunc) WithGroup(string) slog.Handler                 { return h }

// effects is a consumer whose handler records each key's effect in a table,
// so that a test can count how often each operation was applied.
func effects(t *testing.T) (env *testenv.Env, queue string, events <-chan consumer.Event, count func() (rows, keys int)) {
	t.Helper()
	env = testenv.New(t)
	cfg, events := env.ConsumerConfig("pubq", "refunds")
	table := pgx.Identifier{env.Schema, "effects"}.Sanitize()
	if _, err := env.Pool.Exec(t.Context(), "CREATE TABLE "+table+" (key text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	env.Run(cfg, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		_, err := tx.Exec(ctx, "INSERT INTO "+table+" VALUES ($1)", d.Key)
		return consumer.Response{}, err
	})
	count = func() (rows, keys int) {
		if err := env.Pool.QueryRow(context.Background(), "SELECT count(*), count(DISTINCT key) FROM "+table).Scan(&rows, &keys); err != nil {
			t.Fatal(err)
		}
		return rows, keys
	}
	return env, cfg.Queue, events, count
}

// cutConn is a connection that, once it has written a frame holding
// trigger, holds back everything it reads until cut closes, and then fails:
// the broker's confirm of that publish never reaches the client.
type cutConn struct {
	net.Conn
	trigger   []byte
	triggered chan struct{}
	cut       chan struct{}
	once      *sync.Once
}

func (c *cutConn) Write(b []byte) (int, error) {
	if bytes.Contains(b, c.trigger) {
		c.once.Do(func() { close(c.triggered) })
	}
	return c.Conn.Write(b)
}

func (c *cutConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	select {
	case <-c.triggered:
		<-c.cut
		return 0, net.ErrClosed
	default:
		return n, err
	}
}

// TestPublishRetriedAfterConnectionKilled: the broker takes the message and
// its connection is killed before the confirm reaches the publisher.
// Publish retries on a new connection with the same message id; the
// consumer applies the operation once and sees the retry as a duplicate.
func TestPublishRetriedAfterConnectionKilled(t *testing.T) {
	t.Parallel()
	_, queue, events, count := effects(t)
	body := []byte("refund " + testdb.RandomHex(8))
	triggered, cut := make(chan struct{}), make(chan struct{})
	var once sync.Once
	var dials atomic.Int32
	cfg := publish.Config{ConfirmTimeout: time.Minute, AMQPConfig: &amqp.Config{
		Dial: func(network, addr string) (net.Conn, error) {
			conn, err := net.DialTimeout(network, addr, 10*time.Second)
			if err != nil {
				return nil, err
			}
			if dials.Add(1) > 1 {
				return conn, nil
			}
			return &cutConn{Conn: conn, trigger: body, triggered: triggered, cut: cut, once: &once}, nil
		},
	}}
	p, name := newPublisher(t, cfg)
	key := publish.NewKey()
	done := make(chan error, 1)
	go func() { done <- p.Publish(t.Context(), key, publish.Message{RoutingKey: queue, Body: body}) }()

	select {
	case <-triggered:
	case <-time.After(30 * time.Second):
		t.Fatal("the message was not sent within 30s")
	}
	// The broker has the first copy: the consumer applies it.
	testenv.WaitOutcome(t, events, consumer.OutcomeProcessed)
	if n := testamqp.CloseConnections(t, name); n != 1 {
		t.Fatalf("closed %d connections named %s, want 1", n, name)
	}
	close(cut)
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Publish across the killed connection: %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("Publish did not return within a minute of the connection being killed")
	}
	if n := dials.Load(); n != 2 {
		t.Errorf("%d connections opened, want 2", n)
	}
	// The retry carries the same message id: a duplicate, not applied.
	testenv.WaitOutcome(t, events, consumer.OutcomeDuplicate)
	if rows, _ := count(); rows != 1 {
		t.Fatalf("the operation was applied %d times, want once", rows)
	}
}

// TestPublishStreamAcrossConnectionKills is the example's operation
// (requestRefund) run across broker failures: while a stream of operations
// is published, every connection of the publisher is closed from the
// broker's side, again and again. Every operation returns nil, its message
// arrives, and the consumer applies each operation exactly once. (The chaos
// soak restarts the broker itself; that would break every other test running
// in parallel, so here only this publisher's connections die.)
func TestPublishStreamAcrossConnectionKills(t *testing.T) {
	t.Parallel()
	_, queue, events, count := effects(t)
	// Thousands of outcomes: read them, so that the consumer never waits.
	drained := make(chan struct{})
	var drain sync.WaitGroup
	drain.Go(func() {
		for {
			select {
			case <-events:
			case <-drained:
				return
			}
		}
	})
	t.Cleanup(func() { close(drained); drain.Wait() })
	var retries atomic.Int32
	log := slog.New(handlerFunc(func(r slog.Record) {
		if r.Level == slog.LevelWarn {
			retries.Add(1)
		}
	}))
	p, name := newPublisher(t, publish.Config{Logger: log, RetryInitial: 20 * time.Millisecond, RetryMax: 500 * time.Millisecond})
	const workers, wantKills = 8, 3
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()

	stop := make(chan struct{})
	var kills atomic.Int32
	var killer sync.WaitGroup
	killer.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			// rabbitmqctl takes a few hundred milliseconds: it paces the loop.
			kills.Add(int32(testamqp.CloseConnections(t, name)))
		}
	})

	// Operations go on, at a steady pace, until the connection was killed
	// several times and at least one kill caught a publish in flight (a
	// retried attempt).
	const maxKills = 20
	ops := make(chan int)
	keys := make(chan string, 1<<16)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := range ops {
				key, err := requestRefund(ctx, p, queue, "o-"+strconv.Itoa(i))
				if err != nil {
					t.Errorf("operation %d: %v", i, err)
					continue
				}
				keys <- key
			}
		})
	}
	pace := time.NewTicker(5 * time.Millisecond)
	defer pace.Stop()
	operations := 0
	for ; kills.Load() < wantKills || retries.Load() == 0; operations++ {
		if ctx.Err() != nil || kills.Load() >= maxKills || operations == cap(keys) {
			t.Errorf("after %d operations: %d connections killed, %d attempts retried; want %d kills and a retry", operations, kills.Load(), retries.Load(), wantKills)
			break
		}
		<-pace.C
		ops <- operations
	}
	close(ops)
	wg.Wait()
	close(stop)
	killer.Wait()
	close(keys)
	if t.Failed() {
		return
	}
	if len(keys) != operations {
		t.Fatalf("%d operations published, want %d", len(keys), operations)
	}
	t.Logf("%d operations published, %d connections killed, %d attempts retried", operations, kills.Load(), retries.Load())
	consumertest.WaitFor(t, 2*time.Minute, "every operation applied", func() bool {
		_, k := count()
		return k == operations
	})
	if rows, k := count(); rows != operations || k != operations {
		t.Fatalf("%d effects of %d keys, want each of the %d operations applied once", rows, k, operations)
	}
}

// TestPublishTrace: one producer span per Publish, whose context travels in
// the message's traceparent; the key is not among its attributes.
func TestPublishTrace(t *testing.T) {
	t.Parallel()
	ch := testamqp.Channel(t, testamqp.Dial(t))
	q := declareQueue(t, ch, nil)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	p, _ := newPublisher(t, publish.Config{TracerProvider: tp, Propagator: propagation.TraceContext{}})
	key := publish.NewKey()
	headers := amqp.Table{"h": "v"}
	if err := p.Publish(t.Context(), key, publish.Message{RoutingKey: q, Headers: headers}); err != nil {
		t.Fatal(err)
	}
	if len(headers) != 1 {
		t.Errorf("the caller's headers were changed: %v", headers)
	}
	spans := rec.Ended()
	if len(spans) != 1 {
		t.Fatalf("%d spans, want 1", len(spans))
	}
	s := spans[0]
	if s.SpanKind() != trace.SpanKindProducer || s.Name() != "amq.default publish" {
		t.Errorf("span %q of kind %s, want a producer span amq.default publish", s.Name(), s.SpanKind())
	}
	for _, a := range s.Attributes() {
		if a.Value.Emit() == key {
			t.Errorf("attribute %s carries the raw key", a.Key)
		}
		if a.Key == "idemq.publish.attempts" && a.Value.AsInt64() != 1 {
			t.Errorf("attempts %d, want 1", a.Value.AsInt64())
		}
	}
	d := get(t, ch, q)
	tp2, _ := d.Headers["traceparent"].(string)
	if !strings.Contains(tp2, s.SpanContext().TraceID().String()) || !strings.Contains(tp2, s.SpanContext().SpanID().String()) {
		t.Errorf("traceparent %q, want the publish span's context", tp2)
	}
	if d.Headers["h"] != "v" {
		t.Errorf("headers %v lost the caller's", d.Headers)
	}
}

func TestPublishAfterClose(t *testing.T) {
	t.Parallel()
	ch := testamqp.Channel(t, testamqp.Dial(t))
	q := declareQueue(t, ch, nil)
	p, _ := newPublisher(t, publish.Config{})
	if err := p.Publish(t.Context(), publish.NewKey(), publish.Message{RoutingKey: q}); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := p.Publish(t.Context(), publish.NewKey(), publish.Message{RoutingKey: q}); !errors.Is(err, publish.ErrClosed) {
		t.Fatalf("Publish after Close: %v, want ErrClosed", err)
	}
}
