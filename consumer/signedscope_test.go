package consumer_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/wire"
)

// seenDelivery is what a stage's handler saw of a delivery.
type seenDelivery struct {
	attempt         int
	tenant          string
	exchange, route string
	idemq           []string
}

func seeDelivery(d *consumer.Delivery) seenDelivery {
	s := seenDelivery{attempt: d.Attempt, tenant: d.Tenant, exchange: d.OriginalExchange, route: d.OriginalRoutingKey}
	for k := range d.Headers {
		if wire.IsIdemq(k) {
			s.idemq = append(s.idemq, k)
		}
	}
	return s
}

// TestSignedCopyOfAnotherStageIsNotTrusted runs two stages that share one
// header key: A (queue QA, name A) and B (queue QB, name B), both taking the
// tenant from user_id. Alice publishes two messages to A through a topic
// exchange with a routing key of A's: one fails once (a signed retry copy of
// attempt 2 waits in A's tier), one fails for good (a signed dead letter in
// A's DLQ). Both copies, every header kept, are moved into QB. B must not
// trust A's headers: each is a first attempt of tenant "" (the copies have no
// user_id), with its own origin (the default exchange, routing key QB), its
// handler sees no x-idemq-* header, and B's dead letter records QB as the
// original routing key, not A's. The same retry copy put back into QA is
// still A's attempt 2 of alice, with A's routing key: the signature holds
// where it was made for.
func TestSignedCopyOfAnotherStageIsNotTrusted(t *testing.T) {
	forModes(t, func(m mode) bool { return m == modeGroup || m == modeBatch }, func(t *testing.T, m mode) {
		key := []byte("one header key shared by stages A and B")
		stage := func(name string) func(*consumer.Config) {
			return func(c *consumer.Config) {
				c.Name, c.HeaderKeys, c.TenantFromUserID = name, [][]byte{key}, true
				// The retry copy waits in the first tier until the test takes it.
				c.RetryInitial = 10 * time.Minute
			}
		}
		a, b := newHarness(t, m, stage("A")), newHarness(t, m, stage("B"))
		route := "stage-a.orders." + a.cfg.Queue
		if err := a.pub.QueueBind(a.cfg.Queue, route, "amq.topic", false, nil); err != nil {
			t.Fatal(err)
		}
		alice, aliceURL := testamqp.AddUser(t, "alice")
		aliceCh := testamqp.Channel(t, testamqp.DialURL(t, aliceURL))

		var mu sync.Mutex
		seenA, seenB := map[string][]seenDelivery{}, map[string]seenDelivery{}
		a.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			mu.Lock()
			seenA[d.Key] = append(seenA[d.Key], seeDelivery(d))
			n := len(seenA[d.Key])
			mu.Unlock()
			switch {
			case d.Key == "dead":
				return consumer.Response{}, consumer.Permanent(errors.New("refused by A"))
			case n == 1:
				return consumer.Response{}, errInfra
			}
			return consumer.Response{}, nil
		})
		b.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			mu.Lock()
			seenB[d.Key] = seeDelivery(d)
			mu.Unlock()
			return consumer.Response{}, consumer.Permanent(errors.New("refused by B"))
		})

		for _, id := range []string{"retried", "dead"} {
			testamqp.Publish(t, aliceCh, "amq.topic", route, amqp.Publishing{MessageId: id, UserId: alice, Body: []byte(`{}`)})
		}
		tier := consumer.NewTopology(a.cfg.TopologyConfig())
		tierName := tier.TierName(tier.Delays[0])
		a.waitQueue(tierName, 30*time.Second, "A's retry copy", func(q amqp.Queue) bool { return q.Messages >= 1 })
		retry, ok, err := a.pub.Get(tierName, true)
		if err != nil || !ok {
			t.Fatalf("get A's retry copy: %v, %v", ok, err)
		}
		dead := a.waitDLQ(1, 30*time.Second)
		if len(dead) != 1 {
			t.Fatalf("%d dead letters of A, want 1", len(dead))
		}
		if rk, _ := wire.String(dead[0].Headers[wire.HeaderOriginalRoutingKey]); rk != route || dead[0].Headers[wire.HeaderSignature] == nil {
			t.Fatalf("A's dead letter: original routing key %q, signature %v; want %q, signed", rk, dead[0].Headers[wire.HeaderSignature], route)
		}

		// Every header and property kept, into B's queue.
		moved := func(d amqp.Delivery) amqp.Publishing {
			return amqp.Publishing{MessageId: d.MessageId, Body: d.Body, Headers: d.Headers, ContentType: d.ContentType}
		}
		testamqp.Publish(t, b.pub, "", b.cfg.Queue, moved(retry))
		testamqp.Publish(t, b.pub, "", b.cfg.Queue, moved(dead[0]))
		bDead := b.waitDLQ(2, 30*time.Second)
		// The control: the retry copy in its own queue.
		testamqp.Publish(t, a.pub, "", a.cfg.Queue, moved(retry))
		a.waitEvents(30*time.Second, "A's retry copy processed", func(evs []consumer.Event) bool {
			return countOutcomes(evs)[consumer.OutcomeProcessed] >= 1
		})

		mu.Lock()
		defer mu.Unlock()
		if got := seenA["retried"]; len(got) < 2 || got[len(got)-1].attempt != 2 || got[len(got)-1].tenant != alice ||
			got[len(got)-1].exchange != "amq.topic" || got[len(got)-1].route != route {
			t.Errorf("A's retry copy back in QA: %+v; want attempt 2 of %s from amq.topic/%s", got, alice, route)
		}
		for _, id := range []string{"retried", "dead"} {
			s, ok := seenB[id]
			if !ok {
				t.Errorf("B did not handle A's %s copy", id)
				continue
			}
			if s.attempt != 1 || s.tenant != "" || s.exchange != "" || s.route != b.cfg.Queue || len(s.idemq) != 0 {
				t.Errorf("B trusted A's %s copy: attempt %d, tenant %q, origin %q/%q, idemq headers %q; want a first attempt of tenant \"\" from \"\"/%s, no idemq header",
					id, s.attempt, s.tenant, s.exchange, s.route, s.idemq, b.cfg.Queue)
			}
		}
		if len(bDead) != 2 {
			t.Fatalf("%d dead letters of B, want 2", len(bDead))
		}
		for _, d := range bDead {
			ex, _ := wire.String(d.Headers[wire.HeaderOriginalExchange])
			rk, _ := wire.String(d.Headers[wire.HeaderOriginalRoutingKey])
			tenant, _ := wire.String(d.Headers[wire.HeaderTenant])
			if ex != "" || rk != b.cfg.Queue || strings.Contains(tenant, alice) {
				t.Errorf("B's dead letter of %s: origin %q/%q, tenant %q; want \"\"/%s, not %s", d.MessageId, ex, rk, tenant, b.cfg.Queue, alice)
			}
		}
	})
}
