package outbox_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/propagation"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
)

// Environment of the relay child process (TestRelayKilledProcess).
const (
	envRelaySchema = "IDEMQ_TEST_RELAY_SCHEMA"
	envRelayConn   = "IDEMQ_TEST_RELAY_CONNECTION"
	envRelayBatch  = "IDEMQ_TEST_RELAY_BATCH"
)

// TestMain doubles as a relay process for TestRelayKilledProcess.
func TestMain(m *testing.M) {
	if schema := os.Getenv(envRelaySchema); schema != "" {
		os.Exit(runRelayProcess(schema))
	}
	goleak.VerifyTestMain(m)
}

// runRelayProcess runs a relay until it is killed (or a minute passes, so an
// abandoned child does not linger).
func runRelayProcess(schema string) int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, testdb.URL())
	if err != nil {
		fmt.Fprintln(os.Stderr, "relay process:", err)
		return 3
	}
	defer pool.Close()
	batch, _ := strconv.Atoi(os.Getenv(envRelayBatch))
	ob, err := outbox.New(pool, &outbox.Config{Schema: schema})
	if err != nil {
		fmt.Fprintln(os.Stderr, "relay process:", err)
		return 3
	}
	r, err := outbox.NewRelay(ob, testamqp.URL(), &outbox.RelayConfig{
		ConnectionName: os.Getenv(envRelayConn),
		BatchSize:      batch,
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "relay process:", err)
		return 3
	}
	if err := r.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "relay process:", err)
		return 3
	}
	return 0
}

// env is one test's isolated world: a migrated schema, an exchange and a
// queue bound to it with routing key "to-q".
type env struct {
	pool     *pgxpool.Pool
	schema   string
	exchange string
	queue    string
	ob       *outbox.Outbox
	conn     *amqp.Connection
}

const boundKey = "to-q"

func newEnv(t testing.TB, maxConns int32) *env {
	t.Helper()
	pool := testdb.Pool(t, maxConns)
	schemaName := testdb.Schema(t, pool)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := schema.Migrate(ctx, pool, schemaName); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	ob, err := outbox.New(pool, &outbox.Config{Schema: schemaName, Propagator: propagation.TraceContext{}})
	if err != nil {
		t.Fatalf("new outbox: %v", err)
	}
	e := &env{
		pool:     pool,
		schema:   schemaName,
		exchange: testamqp.Name(t, "idemq-test-outbox-x"),
		queue:    testamqp.Name(t, "idemq-test-outbox-q"),
		ob:       ob,
		conn:     testamqp.Dial(t),
	}
	ch, err := e.conn.Channel()
	if err != nil {
		t.Fatalf("channel: %v", err)
	}
	defer ch.Close()
	testamqp.DeleteQueuesAtCleanup(t, []string{e.queue}, []string{e.exchange})
	if err := ch.ExchangeDeclare(e.exchange, amqp.ExchangeDirect, false, false, false, false, nil); err != nil {
		t.Fatalf("declare exchange: %v", err)
	}
	if _, err := ch.QueueDeclare(e.queue, false, false, false, false, nil); err != nil {
		t.Fatalf("declare queue: %v", err)
	}
	if err := ch.QueueBind(e.queue, boundKey, e.exchange, false, nil); err != nil {
		t.Fatalf("bind queue: %v", err)
	}
	return e
}

// relayConfig returns a config for a relay of this env, with a connection
// name unique to the test, fast retries, and logs into the test log.
func (e *env) relayConfig(t testing.TB) *outbox.RelayConfig {
	return &outbox.RelayConfig{
		ConnectionName: testamqp.Name(t, "idemq-test-relay"),
		RetryInitial:   20 * time.Millisecond,
		RetryMax:       100 * time.Millisecond,
		Propagator:     propagation.TraceContext{},
		Logger:         slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
		// LISTEN needs a session: through PgBouncer (make test's second
		// pass) it goes to Postgres directly.
		ListenConfig: testdb.Direct(t),
	}
}

// startRelay runs a relay of the env's outbox until the test ends (then
// waits for it to drain).
func (e *env) startRelay(t testing.TB, cfg *outbox.RelayConfig) *outbox.Relay {
	t.Helper()
	return startRelayOf(t, e.ob, cfg)
}

// startRelayOf runs a relay of ob until the test ends.
func startRelayOf(t testing.TB, ob *outbox.Outbox, cfg *outbox.RelayConfig) *outbox.Relay {
	t.Helper()
	return startRelayURL(t, ob, testamqp.URL(), cfg)
}

// startRelayURL runs a relay of ob to the broker at url until the test ends.
func startRelayURL(t testing.TB, ob *outbox.Outbox, url string, cfg *outbox.RelayConfig) *outbox.Relay {
	t.Helper()
	r, err := outbox.NewRelay(ob, url, cfg)
	if err != nil {
		t.Fatalf("new relay: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("relay run: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Errorf("relay did not stop within 30s")
		}
	})
	return r
}

// backlog reads the outbox backlog.
func (e *env) backlog(t testing.TB) outbox.Backlog {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b, err := e.ob.Pending(ctx)
	if err != nil {
		t.Fatalf("pending: %v", err)
	}
	return b
}

// queueDepth returns the number of ready messages in the env's queue.
func (e *env) queueDepth(t testing.TB) int {
	t.Helper()
	ch, err := e.conn.Channel()
	if err != nil {
		t.Fatalf("channel: %v", err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(e.queue, false, false, false, false, nil)
	if err != nil {
		t.Fatalf("inspect queue: %v", err)
	}
	return q.Messages
}

// consumeAll reads n messages from the queue (failing after the timeout) and
// counts them by message id.
func (e *env) consumeAll(t testing.TB, n int, timeout time.Duration) (map[string]int, []amqp.Delivery) {
	t.Helper()
	ch, err := e.conn.Channel()
	if err != nil {
		t.Fatalf("channel: %v", err)
	}
	defer ch.Close()
	if err := ch.Qos(1000, 0, false); err != nil {
		t.Fatalf("qos: %v", err)
	}
	deliveries, err := ch.Consume(e.queue, "", true, false, false, false, nil)
	if err != nil {
		t.Fatalf("consume: %v", err)
	}
	ids := map[string]int{}
	var all []amqp.Delivery
	deadline := time.After(timeout)
	for len(all) < n {
		select {
		case d, ok := <-deliveries:
			if !ok {
				t.Fatalf("consumer closed after %d of %d messages", len(all), n)
			}
			ids[d.MessageId]++
			all = append(all, d)
		case <-deadline:
			t.Fatalf("timed out after %s with %d of %d messages", timeout, len(all), n)
		}
	}
	return ids, all
}

// collector consumes the queue in the background and counts message ids.
type collector struct {
	mu  sync.Mutex
	ids map[string]int
	n   int
}

func (e *env) collect(t testing.TB) *collector {
	t.Helper()
	ch, err := e.conn.Channel()
	if err != nil {
		t.Fatalf("channel: %v", err)
	}
	if err := ch.Qos(1000, 0, false); err != nil {
		t.Fatalf("qos: %v", err)
	}
	deliveries, err := ch.Consume(e.queue, "", true, false, false, false, nil)
	if err != nil {
		t.Fatalf("consume: %v", err)
	}
	c := &collector{ids: map[string]int{}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for d := range deliveries {
			c.mu.Lock()
			c.ids[d.MessageId]++
			c.n++
			c.mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		_ = ch.Close()
		<-done
	})
	return c
}

func (c *collector) counts() (distinct, total int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.ids), c.n
}

func (c *collector) snapshot() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]int, len(c.ids))
	for k, v := range c.ids {
		out[k] = v
	}
	return out
}

// waitFor polls cond until it holds or the timeout passes.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// testWriter sends log lines to the test log.
type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(string(p))
	return len(p), nil
}
