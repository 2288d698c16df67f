// Package testenv gives an end-to-end test a migrated schema, a key store
// and a broker channel, and runs consumers until the test ends.
package testenv

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
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

// Env is one test's schema (migrated) and broker connection.
type Env struct {
	TB     testing.TB
	Pool   *pgxpool.Pool
	Schema string
	Store  *dedup.Store
	Pub    *amqp.Channel
}

// New migrates a fresh schema (dropped when the test ends) and opens a
// broker channel.
func New(tb testing.TB) *Env {
	tb.Helper()
	pool := testdb.Pool(tb, 20)
	name := testdb.Schema(tb, pool)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := schema.Migrate(ctx, pool, name); err != nil {
		tb.Fatalf("migrate: %v", err)
	}
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: name})
	if err != nil {
		tb.Fatal(err)
	}
	conn := testamqp.Dial(tb)
	return &Env{TB: tb, Pool: pool, Schema: name, Store: store, Pub: testamqp.Channel(tb, conn)}
}

// ConsumerConfig returns the config of a consumer of a fresh queue whose
// topology is declared now and deleted when the test ends; its events go
// to the returned channel.
func (e *Env) ConsumerConfig(prefix, name string) (consumer.Config, <-chan consumer.Event) {
	e.TB.Helper()
	events := make(chan consumer.Event, 1000)
	queue := testamqp.Name(e.TB, prefix)
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
	testamqp.DeleteQueuesAtCleanup(e.TB, queues, []string{topo.DLX})
	if err := consumer.Apply(e.TB.Context(), cfg.URL, cfg.TopologyConfig()); err != nil {
		e.TB.Fatalf("apply topology: %v", err)
	}
	return cfg, events
}

// Run runs a consumer until the test ends.
func (e *Env) Run(cfg consumer.Config, h consumer.Handler) {
	e.TB.Helper()
	c, err := consumer.New(e.Store, h, &cfg)
	if err != nil {
		e.TB.Fatalf("new consumer: %v", err)
	}
	e.RunFunc(c.Run)
}

// RunFunc runs fn until the test ends, then cancels it and waits for it.
func (e *Env) RunFunc(fn func(context.Context) error) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := fn(ctx); err != nil {
			e.TB.Errorf("run: %v", err)
		}
	})
	e.TB.Cleanup(func() { cancel(); wg.Wait() })
}

// Publish sends body to queue with key as message_id (none when "").
func (e *Env) Publish(queue, key, body string, headers amqp.Table) {
	e.TB.Helper()
	testamqp.Publish(e.TB, e.Pub, "", queue, amqp.Publishing{
		MessageId: key, Body: []byte(body), Headers: headers, DeliveryMode: amqp.Persistent,
	})
}

// WaitEvent returns the next event, failing the test after 30s.
func WaitEvent(tb testing.TB, events <-chan consumer.Event) consumer.Event {
	tb.Helper()
	select {
	case ev := <-events:
		return ev
	case <-time.After(30 * time.Second):
		tb.Fatal("no delivery outcome within 30s")
		return consumer.Event{}
	}
}

// WaitOutcome returns the next event, failing the test unless its outcome is want.
func WaitOutcome(tb testing.TB, events <-chan consumer.Event, want consumer.Outcome) consumer.Event {
	tb.Helper()
	ev := WaitEvent(tb, events)
	if ev.Outcome != want {
		tb.Fatalf("outcome %s (reason %q, err %v), want %s", ev.Outcome, ev.Reason, ev.Err, want)
	}
	return ev
}

// Poll calls try every 100ms until it returns true, or fails tb after
// timeout with what describe says.
func Poll(tb testing.TB, timeout time.Duration, try func(context.Context) bool, describe func() string) {
	tb.Helper()
	end := time.Now().Add(timeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		done := try(ctx)
		cancel()
		if done {
			return
		}
		if time.Now().After(end) {
			tb.Fatalf("gave up after %s: %s", timeout, describe())
		}
		time.Sleep(100 * time.Millisecond) // polling an external API: nothing to wait on
	}
}
