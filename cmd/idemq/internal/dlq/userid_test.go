package dlq_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/cmd/idemq/internal/dlq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testamqp"
)

// TestReplayOfALetterTheBrokerDeadLettered: a message published by a second
// broker user, with its user_id, crashes its workers until the work queue's
// x-delivery-limit dead-letters it; the letter keeps the user_id, which the
// replaying user (guest) may not publish. A plain replay leaves it in the
// DLQ and says why; one that keeps the user_id fails with the broker's
// reason; one that drops it moves it and counts it; its publisher's own
// user replays such a letter with its user_id.
func TestReplayOfALetterTheBrokerDeadLettered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	q := testamqp.Name(t, "dlquser")
	cfg := consumer.TopologyConfig{Queue: q, DeliveryLimit: 1}
	topo := consumer.NewTopology(cfg)
	names := []string{q, topo.DLQ}
	for _, d := range topo.Delays {
		names = append(names, topo.TierName(d))
	}
	testamqp.DeleteQueuesAtCleanup(t, names, []string{topo.DLX})
	if err := consumer.Apply(ctx, testamqp.URL(), cfg); err != nil {
		t.Fatalf("topology: %v", err)
	}
	alice, aliceURL := testamqp.AddUser(t, "alice")
	aliceConn := testamqp.DialURL(t, aliceURL)
	testamqp.Publish(t, testamqp.Channel(t, aliceConn), "", q, amqp.Publishing{MessageId: "crash-1", UserId: alice, Body: []byte(`{}`)})

	conn := testamqp.Dial(t)
	ch := testamqp.Channel(t, conn)
	crashUntilDeadLettered(t, ch, q, topo.DLQ)
	_, msgs, err := dlq.Read(ctx, conn, topo.DLQ, 0, 0)
	if err != nil || len(msgs) != 1 || !msgs[0].ByBroker || msgs[0].Reason != consumer.ReasonDeliveryLimit || msgs[0].UserID != alice {
		t.Fatalf("dead letter: %+v, %v", msgs, err)
	}
	waitReady(t, conn, topo.DLQ, 1)

	var logs bytes.Buffer
	opts := dlq.ReplayOptions{Queue: topo.DLQ, Target: q, Logger: slog.New(slog.NewTextHandler(&logs, nil))}

	// By default the letter stays, and the error says why.
	res, err := dlq.Replay(ctx, conn, opts)
	if !errors.Is(err, dlq.ErrForeignUserID) || res.UserIDRefused != 1 || res.Replayed != 0 {
		t.Fatalf("replay: %+v, %v; want the letter left for its user_id", res, err)
	}
	waitReady(t, conn, topo.DLQ, 1)

	t.Logf("replay: %v", err)

	// Kept, the broker refuses it, and the error carries its reason.
	keep := opts
	keep.UserID = dlq.UserIDKeep
	res, err = dlq.Replay(ctx, conn, keep)
	var closed *amqp.Error
	if !errors.As(err, &closed) || closed.Code != amqp.PreconditionFailed || !strings.Contains(err.Error(), "user_id") || res.Replayed != 0 {
		t.Fatalf("replay keeping the user_id: %+v, %v; want the broker's PRECONDITION_FAILED", res, err)
	}
	waitReady(t, conn, topo.DLQ, 1)

	t.Logf("replay keeping the user_id: %v", err)

	// Dropped, it moves, and the result and the log say so.
	drop := opts
	drop.UserID = dlq.UserIDDrop
	res, err = dlq.Replay(ctx, conn, drop)
	if err != nil || res.Replayed != 1 || res.UserIDDropped != 1 {
		t.Fatalf("replay dropping the user_id: %+v, %v", res, err)
	}
	waitReady(t, conn, topo.DLQ, 0)
	d := get(t, ch, q)
	if d.MessageId != "crash-1" || d.UserId != "" {
		t.Fatalf("replayed copy: message_id %q, user_id %q", d.MessageId, d.UserId)
	}
	if !strings.Contains(logs.String(), "without its user_id") || strings.Contains(logs.String(), "crash-1") {
		t.Fatalf("logs (want the drop, never the key):\n%s", logs.String())
	}

	// On its publisher's own connection the user_id is kept.
	testamqp.Publish(t, testamqp.Channel(t, aliceConn), "", q, amqp.Publishing{MessageId: "crash-2", UserId: alice, Body: []byte(`{}`)})
	crashUntilDeadLettered(t, ch, q, topo.DLQ)
	res, err = dlq.Replay(ctx, aliceConn, dlq.ReplayOptions{Queue: topo.DLQ, Target: q})
	if err != nil || res.Replayed != 1 || res.UserIDDropped != 0 {
		t.Fatalf("replay as the publisher: %+v, %v", res, err)
	}
	if d := get(t, ch, q); d.MessageId != "crash-2" || d.UserId != alice {
		t.Fatalf("replayed copy: message_id %q, user_id %q, want %q", d.MessageId, d.UserId, alice)
	}
}

// crashUntilDeadLettered takes the one message of work queue q and gives it
// back, as a worker that crashes on it, until the broker dead-letters it to
// dlqName (the queue's x-delivery-limit).
func crashUntilDeadLettered(t *testing.T, ch *amqp.Channel, q, dlqName string) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		d, ok, err := ch.Get(q, false)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			if err := d.Nack(false, true); err != nil {
				t.Fatal(err)
			}
			continue
		}
		st, err := ch.QueueDeclarePassive(dlqName, true, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		if st.Messages == 1 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not dead-lettered to %s", q, dlqName)
		}
		<-time.After(20 * time.Millisecond) // poll interval
	}
}

// get takes the next message of q, waiting for it.
func get(t *testing.T, ch *amqp.Channel, q string) amqp.Delivery {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		d, ok, err := ch.Get(q, true)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			return d
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: no message", q)
		}
		<-time.After(20 * time.Millisecond) // poll interval
	}
}
