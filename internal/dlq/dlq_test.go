package dlq_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/dlq"
	"github.com/idemq/idemq/internal/header"
	"github.com/idemq/idemq/internal/testamqp"
)

func TestMain(m *testing.M) {
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

func TestParse(t *testing.T) {
	idemq := &amqp.Delivery{MessageId: "k", Body: []byte("xy"), Headers: amqp.Table{
		consumer.HeaderReason:           "idempotency_key_reuse",
		consumer.HeaderError:            "key reused",
		consumer.HeaderAttempts:         int32(2),
		consumer.HeaderFirstSeen:        "2026-01-01T00:00:00Z",
		consumer.HeaderOriginalExchange: "in",
		consumer.HeaderOriginalRouting:  "orders",
		// Tier round trips leave x-death entries: the idemq reason wins.
		"x-death": []any{amqp.Table{"reason": "expired", "queue": "q.retry.1s", "count": int64(1)}},
	}}
	l := dlq.Parse(idemq)
	if l.Reason != "idempotency_key_reuse" || l.ByBroker || l.Attempts != 2 || l.Error != "key reused" ||
		l.OriginalExchange != "in" || l.OriginalRoutingKey != "orders" || l.BodySize != 2 || l.MessageID != "k" {
		t.Errorf("idemq dead letter: %+v", l)
	}

	broker := &amqp.Delivery{MessageId: "k2", Headers: amqp.Table{
		"x-death": []any{
			amqp.Table{"reason": "delivery_limit", "queue": "q", "exchange": "", "routing-keys": []any{"q"}, "count": int64(1)},
			amqp.Table{"reason": "expired", "queue": "q.retry.1s", "exchange": "", "routing-keys": []any{"q.retry.1s"}, "count": int64(3)},
		},
		"x-first-death-reason": "expired",
	}}
	l = dlq.Parse(broker)
	if l.Reason != "delivery_limit" || !l.ByBroker || l.DeathCount != 1 || l.OriginalRoutingKey != "q" {
		t.Errorf("broker dead letter: %+v", l)
	}

	if l = dlq.Parse(&amqp.Delivery{}); l.Reason != consumer.ReasonUnknown {
		t.Errorf("no reason: %+v", l)
	}
}

func TestCopyDropsTheReason(t *testing.T) {
	d := &amqp.Delivery{MessageId: "k", Body: []byte("b"), ContentType: "text/plain", CorrelationId: "c", Headers: amqp.Table{
		consumer.HeaderReason:    "max_attempts_exceeded",
		consumer.HeaderError:     "boom",
		consumer.HeaderAttempts:  int32(5),
		consumer.HeaderAttempt:   int32(1),
		consumer.HeaderFirstSeen: "t0",
		"x-delivery-count":       int64(3),
		"x-custom":               "kept",
	}}
	p := dlq.Copy(d)
	if p.MessageId != "k" || string(p.Body) != "b" || p.ContentType != "text/plain" || p.CorrelationId != "c" || p.DeliveryMode != amqp.Persistent {
		t.Errorf("properties: %+v", p)
	}
	want := amqp.Table{consumer.HeaderAttempt: int32(1), consumer.HeaderFirstSeen: "t0", "x-custom": "kept"}
	if fmt.Sprint(p.Headers) != fmt.Sprint(want) {
		t.Errorf("headers %v, want %v", p.Headers, want)
	}
	if d.Headers[consumer.HeaderReason] == nil {
		t.Error("the dead letter's headers were modified")
	}
}

// TestCopyKeepsTheSignature: the replayed copy of a signed dead letter
// still verifies, so that the consumer trusts its tenant and original
// routing key: idemq's own dead letters (x-idemq-attempt 1) and a retry copy
// the broker dead-lettered itself (x-delivery-limit) with its attempt.
func TestCopyKeepsTheSignature(t *testing.T) {
	keys := header.Keys{{Secret: []byte("a header key of sixteen bytes or more")}}
	for _, attempt := range []int32{1, 3} {
		h := amqp.Table{
			consumer.HeaderAttempt: attempt, consumer.HeaderTenant: "alice", consumer.HeaderOriginalRouting: "orders.created",
			consumer.HeaderOriginalExchange: "orders", consumer.HeaderFirstSeen: "t0",
		}
		keys.Sign(h, "k", []byte("b"), time.Now())
		h[consumer.HeaderReason], h[consumer.HeaderError], h[consumer.HeaderAttempts] = "permanent_error", "boom", attempt
		p := dlq.Copy(&amqp.Delivery{MessageId: "k", Body: []byte("b"), Headers: h})
		if !keys.Verify(p.Headers, p.MessageId, p.Body) {
			t.Errorf("attempt %d: the replayed copy's signature does not verify: %v", attempt, p.Headers)
		}
	}
}

// setup declares a work queue and its DLQ and fills the DLQ with n dead
// letters, alternating two reasons.
func setup(t *testing.T, n int) (*amqp.Connection, string) {
	t.Helper()
	q := testamqp.Name(t, "dlqpkg")
	testamqp.DeleteQueuesAtCleanup(t, []string{q, dlq.Name(q)}, nil)
	conn := testamqp.Dial(t)
	ch := testamqp.Channel(t, conn)
	for _, name := range []string{q, dlq.Name(q)} {
		if _, err := ch.QueueDeclare(name, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range n {
		reason := []string{"idempotency_key_reuse", "permanent_error"}[i%2]
		testamqp.Publish(t, ch, "", dlq.Name(q), amqp.Publishing{
			MessageId: fmt.Sprintf("m-%d", i), Body: []byte("x"),
			Headers: amqp.Table{consumer.HeaderReason: reason, consumer.HeaderAttempt: int32(3)},
		})
	}
	return conn, q
}

func ready(t *testing.T, conn *amqp.Connection, q string) int {
	t.Helper()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return st.Messages
}

func waitReady(t *testing.T, conn *amqp.Connection, q string, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for ready(t, conn, q) != n {
		if time.Now().After(deadline) {
			t.Fatalf("%s: %d ready, want %d", q, ready(t, conn, q), n)
		}
		<-time.After(20 * time.Millisecond) // poll interval
	}
}

func TestListLosesNothing(t *testing.T) {
	t.Parallel()
	conn, q := setup(t, 6)
	ctx := context.Background()
	res, err := dlq.List(ctx, conn, dlq.Name(q), 4)
	if err != nil {
		t.Fatal(err)
	}
	if res.InQueue != 6 || len(res.Letters) != 4 || res.ByReason["idempotency_key_reuse"] != 2 || res.Letters[0].MessageID != "m-0" {
		t.Fatalf("list: %+v", res)
	}
	waitReady(t, conn, dlq.Name(q), 6)
	if _, err := dlq.List(ctx, conn, q+".absent", 0); err == nil {
		t.Fatal("listing a missing queue: want an error")
	}
}

func TestReplayStopsAfterTheMessageInHand(t *testing.T) {
	t.Parallel()
	conn, q := setup(t, 6)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	res, err := dlq.Replay(ctx, conn, dlq.ReplayOptions{
		Queue: dlq.Name(q), Target: q, Reason: "idempotency_key_reuse",
		Progress: func(read, replayed int) {
			if replayed == 2 {
				cancel() // SIGINT after the second replayed message
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if !res.Interrupted || res.Replayed != 2 || res.Skipped != 1 || res.Read != 3 {
		t.Fatalf("replay: %+v", res)
	}
	waitReady(t, conn, q, 2)
	waitReady(t, conn, dlq.Name(q), 4)

	// The rest, without a filter, with a limit.
	res, err = dlq.Replay(context.Background(), conn, dlq.ReplayOptions{Queue: dlq.Name(q), Target: q, Limit: 3})
	if err != nil || res.Replayed != 3 || res.Interrupted {
		t.Fatalf("replay with limit: %+v, %v", res, err)
	}
	waitReady(t, conn, q, 5)
	waitReady(t, conn, dlq.Name(q), 1)

	ch := testamqp.Channel(t, conn)
	d, ok, err := ch.Get(q, true)
	if err != nil || !ok {
		t.Fatalf("get: %v %v", ok, err)
	}
	// The attempt is left as it was (signed headers must stay intact).
	if d.Headers[consumer.HeaderAttempt] != int32(3) || d.Headers[consumer.HeaderReason] != nil {
		t.Errorf("replayed headers: %v", d.Headers)
	}

	// A missing target is refused before anything is read.
	if _, err := dlq.Replay(context.Background(), conn, dlq.ReplayOptions{Queue: dlq.Name(q), Target: q + ".absent"}); err == nil {
		t.Fatal("replay to a missing queue: want an error")
	}
	waitReady(t, conn, dlq.Name(q), 1)
}
