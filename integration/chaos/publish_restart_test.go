package chaos

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/deduptest"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox/publish"
)

// TestPublisherAcrossBrokerRestart publishes a stream of operations with
// outbox/publish, one key made per operation before its first attempt, while
// the soak's own RabbitMQ node is stopped (rabbitmqctl stop) and started
// again. Every Publish returns nil once the broker is back, and a consumer
// on the same node applies every operation's effect exactly once: the
// attempts caught by the restart went again with the same message id.
func TestPublisherAcrossBrokerRestart(t *testing.T) {
	svc := newServices(t)

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	cfg, err := pgxpool.ParseConfig(svc.pgURL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	schema := deduptest.Schema(t, pool)
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	effects := pgx.Identifier{schema, "refunds"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+effects+" (key text NOT NULL, n int NOT NULL DEFAULT 1)"); err != nil {
		t.Fatal(err)
	}

	queue := "idemq.chaos.refunds." + testdb.RandomHex(4)
	ccfg := consumer.Config{
		URL: svc.amqpURL, Queue: queue, Name: "refunds", Concurrency: 4,
		RetryInitial: 200 * time.Millisecond, ShutdownTimeout: 10 * time.Second,
		ConnectionName: "idemq-chaos-refunds-consumer",
		Logger:         slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	if err := consumer.Apply(ctx, svc.amqpURL, ccfg.TopologyConfig()); err != nil {
		t.Fatalf("topology: %v", err)
	}
	t.Cleanup(func() { deleteQueues(t, svc.amqpURL, consumer.NewTopology(ccfg.TopologyConfig())) })
	c, err := consumer.New(store, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		_, err := tx.Exec(ctx, "INSERT INTO "+effects+" (key) VALUES ($1)", d.Key)
		return consumer.Response{}, err
	}, &ccfg)
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	var running sync.WaitGroup
	running.Go(func() {
		if err := c.Run(runCtx); err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("consumer: %v", err)
		}
	})
	defer func() { stop(); running.Wait() }()

	pub, err := publish.New(svc.amqpURL, &publish.Config{
		ConnectionName: "idemq-chaos-refunds-publisher",
		Logger:         slog.New(slog.NewTextHandler(io.Discard, nil)),
		ConfirmTimeout: 5 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()

	// The stream runs until the broker has been stopped and started again,
	// then publishes afterRestart more operations.
	const beforeRestart, afterRestart = 100, 50
	started, restarted := make(chan struct{}), make(chan struct{})
	var keys []string
	var pubErr error
	var longest time.Duration // the publish that waited for the broker
	published := make(chan struct{})
	go func() {
		defer close(published)
		after := -1
		for i := 0; after < afterRestart; i++ {
			if i == beforeRestart {
				close(started)
			}
			select {
			case <-restarted:
				after++
			default:
			}
			key := publish.NewKey() // once per operation, before its first attempt
			t0 := time.Now()
			err := pub.Publish(ctx, key, publish.Message{RoutingKey: queue, Body: fmt.Appendf(nil, `{"order":"o-%d"}`, i)})
			longest = max(longest, time.Since(t0))
			if err != nil {
				pubErr = fmt.Errorf("operation %d: %w", i, err)
				return
			}
			keys = append(keys, key)
		}
	}()

	select {
	case <-started:
	case <-published:
		t.Fatalf("the stream ended before the restart: %v", pubErr)
	}
	// A restart of the whole node, as a deploy or a crash does (stop_app
	// and start_app keep the Erlang VM, and RabbitMQ 3.10 then refuses new
	// at-least-once quorum queues until the node itself restarts).
	// With shared services (a node this test cannot start again) it stops
	// the application alone.
	if svc.mode == "private" {
		err = svc.rabbit.stop(ctx)
	} else {
		err = svc.brokerStopApp(ctx)
	}
	if err != nil {
		t.Fatal(err)
	}
	// Hold the broker down while the stream keeps trying: nothing to wait
	// on but time.
	select {
	case <-time.After(3 * time.Second):
	case <-ctx.Done():
	}
	if err := svc.brokerStart(ctx); err != nil {
		t.Fatal(err)
	}
	close(restarted)
	select {
	case <-published:
	case <-ctx.Done():
		t.Fatal("the publishes did not all return within the test's time")
	}
	if pubErr != nil {
		t.Fatalf("publish across the restart: %v", pubErr)
	}
	if longest < 2*time.Second {
		t.Fatalf("no publish waited for the broker (longest %s): the restart missed the stream", longest)
	}
	operations := len(keys)
	t.Logf("%d operations published across the restart; the longest publish took %s", operations, longest.Round(time.Millisecond))

	// Every operation's effect, exactly once.
	var rows, distinct int
	if err := waitUntil(ctx, 2*time.Minute, func() bool {
		err := pool.QueryRow(ctx, "SELECT count(*), count(DISTINCT key) FROM "+effects).Scan(&rows, &distinct)
		return err == nil && distinct >= operations
	}); err != nil {
		t.Fatalf("effects of %d operations: %d rows, %d distinct keys", operations, rows, distinct)
	}
	if rows != operations || distinct != operations {
		t.Fatalf("effects: %d rows for %d distinct keys, want %d once each", rows, distinct, operations)
	}
	var missing int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM unnest($1::text[]) k WHERE NOT EXISTS (SELECT 1 FROM "+effects+" e WHERE e.key = k)", keys).Scan(&missing); err != nil || missing != 0 {
		t.Fatalf("%d of the published keys have no effect (%v)", missing, err)
	}
}

// deleteQueues removes a test's work queue, tiers, DLQ and DLX.
func deleteQueues(t *testing.T, url string, topo consumer.Topology) {
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Logf("cleanup: %v", err)
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Logf("cleanup: %v", err)
		return
	}
	names := []string{topo.Queue, topo.DLQ}
	for _, d := range topo.Delays {
		names = append(names, topo.TierName(d))
	}
	for _, n := range names {
		if _, err := ch.QueueDelete(n, false, false, false); err != nil {
			t.Logf("cleanup: delete %s: %v", n, err)
			return
		}
	}
	_ = ch.ExchangeDelete(topo.DLX, false, false)
}
