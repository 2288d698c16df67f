package consumer_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
)

func TestOutboxRowsCommitWithTheKeyAndKeepTheirIDs(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, nil)
		h.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			for i := range 2 {
				if err := outbox.Enqueue(ctx, tx, outbox.Message{Exchange: "receipts", Body: fmt.Appendf(nil, "receipt %d of %s", i, d.Key)}); err != nil {
					return consumer.Response{}, err
				}
			}
			if d.Attempt == 1 {
				return consumer.Response{}, errInfra // rolls back the two rows and the key
			}
			return h.ledgerEffect(ctx, tx, d)
		})
		h.publish("order-77", `{}`, nil)
		h.waitEvents(30*time.Second, "processing on the second attempt", func(evs []consumer.Event) bool {
			return countOutcomes(evs)[consumer.OutcomeProcessed] == 1
		})
		rows, err := h.pool.Query(context.Background(), "SELECT message_id FROM "+h.schema+".outbox ORDER BY id")
		if err != nil {
			t.Fatal(err)
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		scope := dedup.Scope{Consumer: "payments", Key: "order-77"}
		want := []string{outbox.MessageID(scope, "", 1), outbox.MessageID(scope, "", 2)}
		if fmt.Sprint(ids) != fmt.Sprint(want) {
			t.Fatalf("outbox message ids %v, want %v (only the committed attempt's, derived from the key)", ids, want)
		}
	})
}

// In a group, the outbox rows a handler enqueued go with its outcome: those
// of a handler that failed after enqueueing are never written, those of its
// group-mates commit, one per message. A row enqueued on a transaction of
// the handler's own is written at once, as always.
func TestOutboxRowsOfAFailedHandlerAreDropped(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, func(c *consumer.Config) { c.Concurrency, c.Group.Linger = 1, 200*time.Millisecond })
		const n = 12
		failing := map[string]bool{keyOf(3, "ob"): true, keyOf(7, "ob"): true}
		own := keyOf(5, "ob")
		for i := range n {
			h.publish(keyOf(i, "ob"), `{}`, nil)
		}
		h.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			if d.Key == own {
				// A transaction of the handler's own: written at once, and
				// committed whatever the handler's outcome.
				if err := pgx.BeginFunc(ctx, h.pool, func(own pgx.Tx) error {
					return outbox.Enqueue(ctx, own, outbox.Message{Exchange: "audit", MessageID: "audit-" + d.Key, Body: []byte("seen")})
				}); err != nil {
					return consumer.Response{}, err
				}
			}
			if err := outbox.Enqueue(ctx, tx, outbox.Message{Exchange: "receipts", Body: []byte("receipt of " + d.Key)}); err != nil {
				return consumer.Response{}, err
			}
			if failing[d.Key] {
				return consumer.Response{}, consumer.Permanent(fmt.Errorf("refused after enqueueing"))
			}
			return h.ledgerEffect(ctx, tx, d)
		})
		h.waitEvents(30*time.Second, "every message's outcome", func(evs []consumer.Event) bool { return finals(evs) >= n })
		rows, err := h.pool.Query(context.Background(), "SELECT convert_from(body, 'UTF8') FROM "+h.schema+".outbox WHERE exchange = 'receipts'")
		if err != nil {
			t.Fatal(err)
		}
		bodies, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]int{}
		for _, b := range bodies {
			got[b]++
		}
		for i := range n {
			key, want := keyOf(i, "ob"), 1
			if failing[key] {
				want = 0
			}
			if got["receipt of "+key] != want {
				t.Errorf("%s: %d receipts in the outbox, want %d", key, got["receipt of "+key], want)
			}
		}
		var audits int
		if err := h.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+h.schema+".outbox WHERE exchange = 'audit'").Scan(&audits); err != nil {
			t.Fatal(err)
		}
		if audits != 1 {
			t.Errorf("%d audit rows from the handler's own transaction, want 1", audits)
		}
	})
}

// A group's outbox rows wake the relays after the group's commit, with no
// NOTIFY in the transaction and no insert trigger: a relay that polls once
// a minute publishes each within seconds of its delivery.
func TestOutboxRowsWakeTheRelayAfterTheCommit(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, nil)
		ctx := context.Background()
		if _, err := h.pool.Exec(ctx, "DROP TRIGGER IF EXISTS outbox_notify ON "+pgx.Identifier{h.schema, "outbox"}.Sanitize()); err != nil {
			t.Fatal(err)
		}
		exchange, sink := testamqp.Name(t, "x"), testamqp.Name(t, "sink")
		testamqp.DeleteQueuesAtCleanup(t, []string{sink}, []string{exchange})
		testamqp.Sink(t, h.pub, exchange, amqp.ExchangeDirect, sink, "receipt")
		out := testamqp.Channel(t, h.conn)
		received, err := out.Consume(sink, "", true, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		heard := listenOutbox(t, h.schema)
		startSleepyRelay(t, h.pool, h.schema)
		for p := nextNote(t, heard); !strings.HasPrefix(p, "idemq-listen-probe-"); p = nextNote(t, heard) {
		}
		h.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			if err := outbox.Enqueue(ctx, tx, outbox.Message{Exchange: exchange, RoutingKey: "receipt", MessageID: "receipt-" + d.Key}); err != nil {
				return consumer.Response{}, err
			}
			return h.ledgerEffect(ctx, tx, d)
		})
		for i := range 5 {
			key := keyOf(i, "wake")
			h.publish(key, `{}`, nil)
			select {
			case d := <-received:
				if d.MessageId != "receipt-"+key {
					t.Fatalf("got %s, want receipt-%s", d.MessageId, key)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("the receipt of %s not published within 10s: the relay was not woken", key)
			}
		}
	})
}

// startSleepyRelay runs a relay of schema's outbox that polls once a
// minute, until the test ends.
func startSleepyRelay(t *testing.T, pool *pgxpool.Pool, schema string) {
	t.Helper()
	ob, err := outbox.New(pool, &outbox.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	r, err := outbox.NewRelay(ob, testamqp.URL(), &outbox.RelayConfig{
		ConnectionName: testamqp.Name(t, "idemq-test-relay"),
		PollInterval:   time.Minute,
		ListenConfig:   testdb.Direct(t),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("relay: %v", err)
		}
	})
}

// listenOutbox returns the notifications of schema's outbox channel until
// the test ends.
func listenOutbox(t *testing.T, schema string) <-chan string {
	t.Helper()
	return testdb.Listen(t, outbox.ChannelName(schema))
}

func nextNote(t *testing.T, heard <-chan string) string {
	t.Helper()
	select {
	case p := <-heard:
		return p
	case <-time.After(10 * time.Second):
		t.Fatal("no notification within 10s")
		return ""
	}
}
