package forward_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/cmd/idemq/internal/forward"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// A message forwarded from Q to X keeps its headers unchanged: the next
// consumer gets what it gets for the same table published to X directly,
// strings with NUL bytes and names and values that are not UTF-8 included.
// Only traceparent/tracestate are the stage's own (the relay's publish span).
func TestStageForwardsHeadersUnchanged(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, 10)
	schemaName := testdb.Schema(t, pool)
	if err := schema.Migrate(ctx, pool, schemaName); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: schemaName})
	if err != nil {
		t.Fatalf("new store: %v", err)
	}

	queue := testamqp.Name(t, "idemq-test-forward-q")
	exchange := testamqp.Name(t, "idemq-test-forward-x")
	out := testamqp.Name(t, "idemq-test-forward-out")
	ccfg := consumer.Config{
		URL: testamqp.URL(), Queue: queue, Name: "forward-test",
		ConnectionName: "idemq-test-" + queue, ShutdownTimeout: 10 * time.Second,
		Logger: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
	}
	topo := consumer.NewTopology(ccfg.TopologyConfig())
	queues := []string{topo.Queue, topo.DLQ, out}
	for _, d := range topo.Delays {
		queues = append(queues, topo.TierName(d))
	}
	testamqp.DeleteQueuesAtCleanup(t, queues, []string{topo.DLX, exchange})
	if err := consumer.Apply(ctx, ccfg.URL, ccfg.TopologyConfig()); err != nil {
		t.Fatalf("apply topology: %v", err)
	}
	conn := testamqp.Dial(t)
	ch := testamqp.Channel(t, conn)
	if err := ch.ExchangeDeclare(exchange, amqp.ExchangeDirect, false, false, false, false, nil); err != nil {
		t.Fatalf("declare exchange: %v", err)
	}
	if _, err := ch.QueueDeclare(out, false, false, false, false, nil); err != nil {
		t.Fatalf("declare queue: %v", err)
	}
	if err := ch.QueueBind(out, "out", exchange, false, nil); err != nil {
		t.Fatalf("bind queue: %v", err)
	}

	stage, err := forward.New(store, forward.Config{
		Consumer: ccfg, Exchange: exchange, RoutingKey: "out",
		Relay: outbox.RelayConfig{ConnectionName: "idemq-test-relay-" + queue},
	})
	if err != nil {
		t.Fatalf("new stage: %v", err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- stage.Run(runCtx) }()
	t.Cleanup(func() {
		stop()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("run: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Errorf("stage did not stop within 30s")
		}
	})

	testamqp.Publish(t, ch, "", queue, amqp.Publishing{MessageId: "forwarded", Headers: testamqp.EveryHeaderType()})
	testamqp.Publish(t, ch, exchange, "out", amqp.Publishing{MessageId: "direct", Headers: testamqp.EveryHeaderType()})

	deliveries, err := ch.Consume(out, "", true, false, false, false, nil)
	if err != nil {
		t.Fatalf("consume: %v", err)
	}
	headers := map[string]amqp.Table{}
	timeout := time.After(30 * time.Second)
	for len(headers) < 2 {
		select {
		case d := <-deliveries:
			headers[d.MessageId] = d.Headers
		case <-timeout:
			t.Fatalf("timed out with %d of 2 messages at X (outcomes so far: %v)", len(headers), stage.Counts())
		}
	}
	forwarded := headers["forwarded"]
	delete(forwarded, "traceparent")
	delete(forwarded, "tracestate")
	if diff := testamqp.HeadersDiff(forwarded, headers["direct"]); diff != "" {
		t.Fatalf("forwarded headers differ from the same headers published directly:%s", diff)
	}
}

// testWriter sends log lines to the test log.
type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(string(p))
	return len(p), nil
}
