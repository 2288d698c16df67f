package consumer_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/testamqp"
)

// What the key rows and the events say: a key given up on reads as released,
// with the reason that released it; a rejection keeps its reason in the row,
// in the events of the delivery and of its duplicate, and in both replies.
func TestKeysTellWhatHappened(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, nil)
		replies := testamqp.Name(t, "replies")
		testamqp.DeleteQueuesAtCleanup(t, []string{replies}, nil)
		if _, err := h.pub.QueueDeclare(replies, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		h.start(2, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			switch {
			case strings.HasPrefix(d.Key, "reject"):
				return consumer.Response{}, consumer.Reject(402, "insufficient funds", []byte(`{"balance":3}`))
			case strings.HasPrefix(d.Key, "permanent"):
				return consumer.Response{}, consumer.Permanent(errors.New("amount is not a number"))
			case strings.HasPrefix(d.Key, "infra"):
				return consumer.Response{}, errInfra
			}
			return h.ledgerEffect(ctx, tx, d)
		})
		request := amqp.Publishing{MessageId: "reject-1", Body: []byte(`{"amount":5}`), ReplyTo: replies, CorrelationId: "c-1"}
		testPublish(t, h, request)
		h.publish("permanent-1", `{"amount":"x"}`, nil)
		h.publish("infra-1", `{"amount":3}`, nil)
		h.waitEvents(60*time.Second, "the first round", func(evs []consumer.Event) bool {
			c := countOutcomes(evs)
			return c[consumer.OutcomeRejected] == 1 && c[consumer.OutcomeDeadLettered] == 2
		})
		testPublish(t, h, request)
		evs := h.waitEvents(30*time.Second, "the duplicate", func(evs []consumer.Event) bool {
			return countOutcomes(evs)[consumer.OutcomeDuplicate] == 1
		})
		for _, ev := range evs {
			switch ev.Outcome {
			case consumer.OutcomeRejected, consumer.OutcomeDuplicate:
				if ev.RejectReason != "insufficient funds" {
					t.Errorf("%s event: RejectReason %q, want %q", ev.Outcome, ev.RejectReason, "insufficient funds")
				}
			default:
				if ev.RejectReason != "" {
					t.Errorf("%s event: RejectReason %q, want none", ev.Outcome, ev.RejectReason)
				}
			}
		}

		ctx := context.Background()
		rec, err := h.store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: "reject-1"})
		if err != nil {
			t.Fatal(err)
		}
		if rec.Result == nil || rec.Result.Reason != "insufficient funds" || rec.Result.Code != 402 {
			t.Fatalf("stored rejection %+v, want code 402 with its reason", rec.Result)
		}
		for key, reason := range map[string]string{"permanent-1": consumer.ReasonPermanentError, "infra-1": consumer.ReasonMaxAttemptsExceeded} {
			rec, err := h.store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: key})
			if err != nil {
				t.Fatal(err)
			}
			if !rec.Released || rec.ReleaseReason != reason || rec.LeaseValid {
				t.Errorf("%s: released %v, reason %q, lease valid %v; want released by %s",
					key, rec.Released, rec.ReleaseReason, rec.LeaseValid, reason)
			}
		}

		// The first processing's reply and the duplicate's carry the same result.
		h.waitQueue(replies, 10*time.Second, "2 replies", func(q amqp.Queue) bool { return q.Messages >= 2 })
		for i := range 2 {
			d, ok, err := h.pub.Get(replies, true)
			if err != nil || !ok {
				t.Fatalf("reply %d: %v, %v", i, ok, err)
			}
			want := amqp.Table{
				consumer.HeaderOutcome:        "rejected",
				consumer.HeaderResponseCode:   int32(402),
				consumer.HeaderResponseReason: "insufficient funds",
			}
			if diff := testamqp.HeadersDiff(d.Headers, want); diff != "" {
				t.Errorf("reply %d headers: %s", i, diff)
			}
			if string(d.Body) != `{"balance":3}` || d.CorrelationId != "c-1" {
				t.Errorf("reply %d: body %q, correlation id %q", i, d.Body, d.CorrelationId)
			}
		}
	})
}
