package forward_test

import (
	"context"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/cmd/idemq/internal/forward"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/internal/wire"
	"github.com/idemq/idemq/outbox"
)

// stageEnv is a forward stage from a fresh work queue to a fresh topic
// exchange, and a queue bound to everything that exchange receives.
type stageEnv struct {
	t        *testing.T
	queue    string
	received <-chan amqp.Delivery
	pub      *amqp.Channel
	store    *dedup.Store
}

// runStage migrates a fresh schema, declares the topology and runs a stage
// until the test ends; mod adjusts the consumer's config.
func runStage(t *testing.T, mod func(*consumer.Config)) *stageEnv {
	t.Helper()
	ctx := context.Background()
	pool := testdb.Pool(t, 10)
	schemaName := testdb.Schema(t, pool)
	if err := schema.Migrate(ctx, pool, schemaName); err != nil {
		t.Fatal(err)
	}
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: schemaName})
	if err != nil {
		t.Fatal(err)
	}
	discard := slog.New(slog.NewTextHandler(io.Discard, nil))
	queue := testamqp.Name(t, "fwd")
	cfg := consumer.Config{
		URL: testamqp.URL(), Queue: queue, Name: "forwarder", Concurrency: 2,
		ShutdownTimeout: 10 * time.Second, ConnectionName: "idemq-test-" + queue, Logger: discard, NoReply: true,
	}
	if mod != nil {
		mod(&cfg)
	}
	topo := consumer.NewTopology(cfg.TopologyConfig())
	queues := []string{topo.Queue, topo.DLQ}
	for _, d := range topo.Delays {
		queues = append(queues, topo.TierName(d))
	}
	exchange, sink := queue+".out", queue+".sink"
	testamqp.DeleteQueuesAtCleanup(t, append(queues, sink), []string{topo.DLX, exchange})
	if err := consumer.Apply(ctx, cfg.URL, cfg.TopologyConfig()); err != nil {
		t.Fatalf("apply topology: %v", err)
	}
	conn := testamqp.Dial(t)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	testamqp.Sink(t, ch, exchange, amqp.ExchangeTopic, sink, "#")
	received, err := ch.Consume(sink, "", true, true, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}

	stage, err := forward.New(store, forward.Config{
		Consumer: cfg, Exchange: exchange,
		Relay: outbox.RelayConfig{Logger: discard, ConnectionName: "idemq-test-" + queue + "-relay"},
	})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := stage.Run(runCtx); err != nil {
			t.Errorf("run: %v", err)
		}
	})
	t.Cleanup(func() { cancel(); wg.Wait() })
	return &stageEnv{t: t, queue: queue, received: received, pub: testamqp.Channel(t, conn), store: store}
}

// next returns the next message the stage forwarded.
func (e *stageEnv) next() amqp.Delivery {
	e.t.Helper()
	select {
	case d := <-e.received:
		return d
	case <-time.After(30 * time.Second):
		e.t.Fatal("nothing forwarded within 30s")
		return amqp.Delivery{}
	}
}

// TestForgedOriginalRoutingKeyDoesNotSteer publishes to the work queue a
// message whose publisher wrote x-idemq-original-routing-key itself: the
// stage must forward it with the routing key it was published with, not the
// one the header names.
func TestForgedOriginalRoutingKeyDoesNotSteer(t *testing.T) {
	t.Parallel()
	e := runStage(t, nil)
	testamqp.Publish(t, e.pub, "", e.queue, amqp.Publishing{
		MessageId: "steer-1", Body: []byte(`{"delete":"everything"}`),
		Headers: amqp.Table{
			wire.HeaderOriginalRoutingKey: "admin.delete-all",
			wire.HeaderOriginalExchange:   "admin",
			wire.HeaderAttempt:            int32(2),
		},
	})
	d := e.next()
	if d.RoutingKey != e.queue || d.MessageId != "steer-1" {
		t.Fatalf("forwarded %q with routing key %q, want %q (the forged header said admin.delete-all)", d.MessageId, d.RoutingKey, e.queue)
	}
}

// TestSignedOriginalRoutingKeyIsKept: a retry copy as idemq writes it comes
// back from its tier with the work queue's name as routing key; the stage
// forwards it with the routing key its signed headers record.
func TestSignedOriginalRoutingKeyIsKept(t *testing.T) {
	t.Parallel()
	key := []byte("the header key of this test stage")
	e := runStage(t, func(c *consumer.Config) { c.HeaderKeys = [][]byte{key} })
	h := amqp.Table{wire.HeaderAttempt: int32(2), wire.HeaderOriginalExchange: "orders", wire.HeaderOriginalRoutingKey: "orders.created"}
	wire.Keys{{Secret: key}}.For(e.queue, "forwarder").Sign(h, "retried-1", []byte("{}"), time.Now())
	testamqp.Publish(t, e.pub, "", e.queue, amqp.Publishing{MessageId: "retried-1", Body: []byte("{}"), Headers: h})
	d := e.next()
	if d.RoutingKey != "orders.created" || d.MessageId != "retried-1" {
		t.Fatalf("forwarded %q with routing key %q, want orders.created", d.MessageId, d.RoutingKey)
	}
	for k := range d.Headers {
		if wire.IsIdemq(k) {
			t.Errorf("forwarded with idemq's header %s", k)
		}
	}
}

// TestOriginalRoutingKeySignedForAnotherStageDoesNotSteer: a copy signed
// with the stage's own key, but for another stage (another queue, or another
// consumer name on this queue), as a dead letter of stage A moved into stage
// B's queue is: the stage forwards it with the routing key it was published
// with, not the one A's signed headers record.
func TestOriginalRoutingKeySignedForAnotherStageDoesNotSteer(t *testing.T) {
	t.Parallel()
	key := []byte("the header key shared by two stages")
	e := runStage(t, func(c *consumer.Config) { c.HeaderKeys = [][]byte{key} })
	for id, ks := range map[string]wire.Keys{
		"other-queue": wire.Keys{{Secret: key}}.For(e.queue+".stage-a", "forwarder"),
		"other-name":  wire.Keys{{Secret: key}}.For(e.queue, "stage-a"),
	} {
		h := amqp.Table{wire.HeaderAttempt: int32(1), wire.HeaderOriginalExchange: "a", wire.HeaderOriginalRoutingKey: "stage-a.only"}
		ks.Sign(h, id, []byte("{}"), time.Now())
		testamqp.Publish(t, e.pub, "", e.queue, amqp.Publishing{MessageId: id, Body: []byte("{}"), Headers: h})
	}
	for range 2 {
		d := e.next()
		if d.RoutingKey != e.queue {
			t.Errorf("forwarded %q with routing key %q, want %q (its headers were signed for another stage)", d.MessageId, d.RoutingKey, e.queue)
		}
		for k := range d.Headers {
			if wire.IsIdemq(k) {
				t.Errorf("forwarded %q with idemq's header %s", d.MessageId, k)
			}
		}
	}
}
