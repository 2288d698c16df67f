package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/confirm"
	"github.com/idemq/idemq/internal/wire"
)

// Tests of the rule "a message is acked only after what replaces it is
// durable" at the edges where the replacing copy has nowhere to go.

func alwaysFails(context.Context, pgx.Tx, *consumer.Delivery) (consumer.Response, error) {
	return consumer.Response{}, errInfra
}

// queueHolds waits until the named queue holds n messages (ready and
// unacked: the consumer is stopped first, so all are ready).
func (h *harness) queueHolds(name string, n int, timeout time.Duration) {
	h.t.Helper()
	h.waitQueue(name, timeout, fmt.Sprintf("%d messages", n), func(q amqp.Queue) bool { return q.Messages == n })
}

// waitConsumers waits until the work queue has n consumers (their topology
// declared).
func (h *harness) waitConsumers(n int, timeout time.Duration) {
	h.t.Helper()
	h.waitQueue(h.cfg.Queue, timeout, fmt.Sprintf("%d consumers", n), func(q amqp.Queue) bool { return q.Consumers >= n })
}

func copyFailures(evs []consumer.Event, target error) int {
	n := 0
	for _, e := range evs {
		if e.Outcome == consumer.OutcomeCopyFailed && errors.Is(e.Err, target) {
			n++
		}
	}
	return n
}

// A consumer whose retry policy names tiers the applied topology lacks
// (SkipDeclare, other delays): the retry copy is unroutable, so the message
// goes back to the work queue instead of being acked into nowhere.
func TestMissingRetryTierKeepsTheMessage(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, nil)
		h.cfg.SkipDeclare = true
		h.cfg.RetryInitial = 7 * time.Second // tier Q.retry.7s was never declared
		h.cfg.MaxAttempts = 5
		stop := h.start(1, alwaysFails)
		h.publish("k-1", `{"n":1}`, nil)
		evs := h.waitEvents(30*time.Second, "two unroutable retry copies", func(evs []consumer.Event) bool {
			return copyFailures(evs, consumer.ErrUnroutable) >= 2
		})
		for _, e := range evs {
			if e.Outcome == consumer.OutcomeRetried {
				t.Errorf("reported retried although the tier does not exist: %+v", e)
			}
		}
		stop()
		h.queueHolds(h.cfg.Queue, 1, 10*time.Second)
	})
}

// The DLQ deleted while the consumer runs: dead letters wait in the work
// queue, and reach the DLQ with their reason once it is back.
func TestDLQDeletedWhileRunningKeepsTheMessage(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, nil)
		stop := h.start(1, h.ledgerEffect)
		h.waitConsumers(1, 30*time.Second)
		ch, err := h.conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ch.QueueDelete(h.cfg.Queue+".dlq", false, false, false); err != nil {
			t.Fatalf("delete DLQ: %v", err)
		}
		_ = ch.Close()
		h.publish("", `{"no":"key"}`, nil) // idempotency_key_required
		h.waitEvents(30*time.Second, "an unroutable dead-letter copy", func(evs []consumer.Event) bool {
			return copyFailures(evs, consumer.ErrUnroutable) >= 1
		})
		if err := consumer.Apply(t.Context(), h.cfg.URL, h.cfg.TopologyConfig()); err != nil {
			t.Fatalf("re-apply topology: %v", err)
		}
		got := h.waitDLQ(1, 30*time.Second)
		if r := wire.ReadLetter(&got[0]).Reason; r != consumer.ReasonKeyRequired {
			t.Errorf("dead letter reason %q, want %q", r, consumer.ReasonKeyRequired)
		}
		stop()
		h.queueHolds(h.cfg.Queue, 0, 10*time.Second)
	})
}

// A reply_to queue that does not exist: the effect commits once, the
// message is settled, and the failed reply is reported, not claimed sent.
func TestMissingReplyQueueIsReported(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, nil)
		stop := h.start(1, h.ledgerEffect)
		testPublish(t, h, amqp.Publishing{MessageId: "k-reply", Body: []byte(`{}`), ReplyTo: "no-such-reply-queue-" + h.cfg.Queue})
		evs := h.waitEvents(30*time.Second, "processed", func(evs []consumer.Event) bool { return finals(evs) >= 1 })
		if evs[0].Outcome != consumer.OutcomeProcessed {
			t.Fatalf("outcome %s, want processed", evs[0].Outcome)
		}
		if !errors.Is(evs[0].ReplyErr, consumer.ErrUnroutable) {
			t.Errorf("ReplyErr = %v, want ErrUnroutable", evs[0].ReplyErr)
		}
		if n := h.effects()["k-reply"]; n != 1 {
			t.Errorf("%d effects, want 1", n)
		}
		stop()
		h.queueHolds(h.cfg.Queue, 0, 10*time.Second)
	})
}

func testPublish(t *testing.T, h *harness, msg amqp.Publishing) {
	t.Helper()
	ch := h.pub
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", h.cfg.Queue, false, false, msg)
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := dc.WaitContext(ctx); err != nil || !ok {
		t.Fatalf("publish not confirmed: %v", err)
	}
}

// paddedPublishing is a message with key whose header frame is size bytes.
func paddedPublishing(t *testing.T, key string, size int) amqp.Publishing {
	t.Helper()
	msg := amqp.Publishing{MessageId: key, Body: []byte(`{"big":"headers"}`), Headers: amqp.Table{"pad": ""}}
	base, err := confirm.HeaderFrameSize(msg)
	if err != nil {
		t.Fatal(err)
	}
	msg.Headers["pad"] = strings.Repeat("p", size-base)
	return msg
}

// failsOnce fails the first attempt of every key with an infrastructure error.
func (h *harness) failsOnce(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
	if d.Attempt == 1 {
		return consumer.Response{}, errInfra
	}
	return h.ledgerEffect(ctx, tx, d)
}

func channelKills(evs []consumer.Event) int { return copyFailures(evs, consumer.ErrChannelClosed) }

// A message whose headers leave no room for idemq's own: its retry copy is
// trimmed (first-seen, original exchange and routing key, trace context
// dropped) instead of killing the connection, and it is processed once.
func TestRetryCopyNearFrameMaxIsTrimmed(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, nil)
		stop := h.start(1, h.failsOnce)
		testPublish(t, h, paddedPublishing(t, "k-near", h.conn.Config.FrameSize-consumer.DeathReserve(&h.cfg)-200))
		evs := h.waitEvents(60*time.Second, "processed", func(evs []consumer.Event) bool { return finals(evs) >= 1 })
		if n := channelKills(evs); n != 0 {
			t.Errorf("%d copies were lost with their channel", n)
		}
		if got := countOutcomes(evs); got[consumer.OutcomeProcessed] != 1 || got[consumer.OutcomeRetried] != 1 {
			t.Errorf("outcomes %v, want one retry then processed", got)
		}
		if n := h.effects()["k-near"]; n != 1 {
			t.Errorf("%d effects, want 1", n)
		}
		stop()
	})
}

// A message whose headers fill the frame: no copy of it can carry them, so
// it is dead-lettered headers_too_large with its body, the largest headers
// dropped and named, and the connection never dies over it.
func TestCopyThatCannotFitIsDeadLetteredHeadersTooLarge(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, nil)
		stop := h.start(1, alwaysFails)
		testPublish(t, h, paddedPublishing(t, "k-full", h.conn.Config.FrameSize))
		got := h.waitDLQ(1, 60*time.Second)
		stop()
		d := got[0]
		if r := wire.ReadLetter(&d).Reason; r != consumer.ReasonHeadersTooLarge {
			t.Errorf("reason %q, want %q", r, consumer.ReasonHeadersTooLarge)
		}
		if e := wire.ReadLetter(&d).Error; !strings.Contains(e, "dropped: pad") {
			t.Errorf("error header %q does not name the dropped header", e)
		}
		if string(d.Body) != `{"big":"headers"}` || d.MessageId != "k-full" {
			t.Errorf("dead letter body %q message_id %q: not the original", d.Body, d.MessageId)
		}
		h.mu.Lock()
		evs := append([]consumer.Event(nil), h.events...)
		h.mu.Unlock()
		if n := channelKills(evs); n != 0 {
			t.Errorf("%d copies were lost with their channel", n)
		}
		h.queueHolds(h.cfg.Queue, 0, 10*time.Second)
	})
}
