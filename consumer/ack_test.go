package consumer_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testamqp"
)

// Acks are coalesced into multiple-acks, which cover every delivery up to a
// tag: a slow delivery below finished ones must neither be acked with them
// nor hold their acks back, and a stop must send every ack it holds.
func TestCoalescedAcksNeverCoverASlowDelivery(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, func(c *consumer.Config) { c.Concurrency = 4 })
		started, release := make(chan struct{}), make(chan struct{})
		stop := h.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			if d.Key == "slow" {
				close(started)
				select {
				case <-release:
				case <-ctx.Done():
					return consumer.Response{}, ctx.Err()
				}
			}
			return h.ledgerEffect(ctx, tx, d)
		})

		h.publish("slow", `{"n":0}`, nil)
		select {
		case <-started:
		case <-time.After(15 * time.Second):
			t.Fatal("the slow handler did not start within 15s")
		}
		const fast = 40
		for i := range fast {
			h.publish(keyOf(i, "fast"), `{"n":1}`, nil)
		}
		h.waitEvents(20*time.Second, "the fast messages' outcomes", func(evs []consumer.Event) bool { return finals(evs) >= fast })

		// The broker sees every fast message acked and the slow one not.
		waitUnacked(t, h.cfg.Queue, 1, 10*time.Second)

		close(release)
		h.waitEvents(20*time.Second, "the slow message's outcome", func(evs []consumer.Event) bool { return finals(evs) >= fast+1 })
		stop()

		// Nothing went back to the queue at the stop: every ack was sent.
		q, err := h.pub.QueueDeclarePassive(h.cfg.Queue, true, false, false, false, amqp.Table{"x-queue-type": "quorum"})
		if err != nil {
			t.Fatal(err)
		}
		if q.Messages != 0 {
			t.Fatalf("%d messages back in the queue after a graceful stop, want 0", q.Messages)
		}
		for key, n := range h.effects() {
			if n != 1 {
				t.Errorf("key %s applied %d times", key, n)
			}
		}
		if got := len(h.effects()); got != fast+1 {
			t.Fatalf("%d keys applied, want %d", got, fast+1)
		}
	})
}

// waitUnacked waits until the broker counts want unacked messages on queue.
func waitUnacked(t *testing.T, queue string, want int, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		got := testamqp.Unacked(t, queue)
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("broker counts %d unacked messages on %s after %s, want %d", got, queue, timeout, want)
		}
		select {
		case <-time.After(200 * time.Millisecond):
		case <-t.Context().Done():
			t.Fatal(t.Context().Err())
		}
	}
}
