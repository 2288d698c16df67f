package integration

import (
	"context"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

// env is one test's schema (migrated) and broker connection.
type env struct {
	tb     testing.TB
	pool   *pgxpool.Pool
	schema string
	store  *dedup.Store
	pub    *amqp.Channel
}

func newEnv(tb testing.TB) *env {
	tb.Helper()
	pool := testdb.Pool(tb, 20)
	schema := testdb.Schema(tb, pool)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := dedup.Migrate(ctx, pool, schema); err != nil {
		tb.Fatalf("migrate: %v", err)
	}
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: schema})
	if err != nil {
		tb.Fatal(err)
	}
	conn := testamqp.Dial(tb)
	return &env{tb: tb, pool: pool, schema: schema, store: store, pub: testamqp.Channel(tb, conn)}
}

// consumerConfig returns the config of a consumer of a fresh queue whose
// topology is declared now and deleted when the test ends; its events go
// to the returned channel.
func (e *env) consumerConfig(prefix, name string) (consumer.Config, <-chan consumer.Event) {
	e.tb.Helper()
	events := make(chan consumer.Event, 1000)
	queue := testamqp.Name(e.tb, prefix)
	cfg := consumer.Config{
		URL:             testamqp.URL(),
		Queue:           queue,
		Name:            name,
		Concurrency:     4,
		RetryInitial:    200 * time.Millisecond,
		RetryMultiplier: 2,
		MaxAttempts:     3,
		ShutdownTimeout: 10 * time.Second,
		ConnectionName:  "idemq-test-" + queue,
		Logger:          slog.New(slog.NewTextHandler(io.Discard, nil)),
		OnOutcome:       func(ev consumer.Event) { events <- ev },
	}
	topo := consumer.NewTopology(cfg.TopologyConfig())
	queues := []string{topo.Queue, topo.DLQ}
	for _, d := range topo.Delays {
		queues = append(queues, topo.TierName(d))
	}
	testamqp.DeleteQueuesAtCleanup(e.tb, queues, []string{topo.DLX})
	if err := consumer.Apply(e.tb.Context(), cfg.URL, cfg.TopologyConfig()); err != nil {
		e.tb.Fatalf("apply topology: %v", err)
	}
	return cfg, events
}

// run runs a consumer until the test ends.
func (e *env) run(cfg consumer.Config, h consumer.Handler) {
	e.tb.Helper()
	c, err := consumer.New(e.store, h, &cfg)
	if err != nil {
		e.tb.Fatalf("new consumer: %v", err)
	}
	e.runFunc(c.Run)
}

// runFunc runs fn until the test ends, then cancels it and waits for it.
func (e *env) runFunc(fn func(context.Context) error) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := fn(ctx); err != nil {
			e.tb.Errorf("run: %v", err)
		}
	})
	e.tb.Cleanup(func() { cancel(); wg.Wait() })
}

// publish sends body to queue with key as message_id (none when "").
func (e *env) publish(queue, key, body string, headers amqp.Table) {
	e.tb.Helper()
	testamqp.Publish(e.tb, e.pub, "", queue, amqp.Publishing{
		MessageId: key, Body: []byte(body), Headers: headers, DeliveryMode: amqp.Persistent,
	})
}

// waitEvent returns the next event, failing the test after 30s.
func waitEvent(tb testing.TB, events <-chan consumer.Event) consumer.Event {
	tb.Helper()
	select {
	case ev := <-events:
		return ev
	case <-time.After(30 * time.Second):
		tb.Fatal("no delivery outcome within 30s")
		return consumer.Event{}
	}
}

// waitOutcome returns the next event, failing the test unless its outcome is want.
func waitOutcome(tb testing.TB, events <-chan consumer.Event, want consumer.Outcome) consumer.Event {
	tb.Helper()
	ev := waitEvent(tb, events)
	if ev.Outcome != want {
		tb.Fatalf("outcome %s (reason %q, err %v), want %s", ev.Outcome, ev.Reason, ev.Err, want)
	}
	return ev
}
