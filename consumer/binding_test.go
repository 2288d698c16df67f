package consumer_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testamqp"
)

// A work queue bound to a topic exchange that another queue is bound to
// too: a message published there fails, goes through every retry tier and
// is dead-lettered, and the other queue holds only the original publish,
// never a retry or dead-letter copy (the copies go to Q's tiers through the
// default exchange and to Q.dlx, never back through the bound exchange).
func TestRetriesNeverGoBackThroughBoundExchanges(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		exchange := testamqp.Name(t, "orders")
		other := testamqp.Name(t, "audit")
		testamqp.DeleteQueuesAtCleanup(t, []string{other}, []string{exchange})
		h := newHarness(t, m, func(c *consumer.Config) {
			c.Bindings = []consumer.Binding{{Exchange: exchange, Kind: amqp.ExchangeTopic, Key: "order.*", Declare: true}}
		})
		ch := testamqp.Channel(t, h.conn)
		if _, err := ch.QueueDeclare(other, false, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		if err := ch.QueueBind(other, "order.#", exchange, false, nil); err != nil {
			t.Fatal(err)
		}
		h.start(1, func(context.Context, pgx.Tx, *consumer.Delivery) (consumer.Response, error) {
			return consumer.Response{}, errInfra
		})
		testamqp.Publish(t, h.pub, exchange, "order.created", amqp.Publishing{MessageId: "k-1", Body: []byte(`{"order":1}`)})

		dead := h.waitDLQ(1, 30*time.Second)
		if got := dead[0].Headers["x-idemq-reason"]; got != consumer.ReasonMaxAttemptsExceeded {
			t.Fatalf("reason %v, want %s", got, consumer.ReasonMaxAttemptsExceeded)
		}
		evs := h.waitEvents(10*time.Second, "every attempt", func(evs []consumer.Event) bool { return finals(evs) == 1 })
		if n := countOutcomes(evs)[consumer.OutcomeRetried]; n != h.cfg.MaxAttempts-1 {
			t.Fatalf("%d retries, want %d", n, h.cfg.MaxAttempts-1)
		}
		q, err := ch.QueueDeclarePassive(other, false, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		if q.Messages != 1 {
			t.Fatalf("the other queue on %s holds %d messages, want only the original publish", exchange, q.Messages)
		}
		d, ok, err := ch.Get(other, true)
		if err != nil || !ok {
			t.Fatalf("get %s: ok %v, %v", other, ok, err)
		}
		if d.RoutingKey != "order.created" || d.Headers["x-idemq-attempt"] != nil {
			t.Fatalf("the other queue got a copy (routing key %q, headers %v)", d.RoutingKey, d.Headers)
		}
	})
}

// Bindings are checked before Apply connects.
func TestBindingsAreValidated(t *testing.T) {
	t.Parallel()
	for _, b := range []consumer.Binding{
		{Exchange: "", Key: "k"},
		{Exchange: "q.dlx", Key: ""},
		{Exchange: "orders", Key: "order.*", Declare: true},
		{Exchange: "events", Kind: amqp.ExchangeHeaders, Args: amqp.Table{"bad": struct{}{}}},
	} {
		err := consumer.Apply(t.Context(), "amqp://127.0.0.1:1/", consumer.TopologyConfig{Queue: "q", Bindings: []consumer.Binding{b}})
		if err == nil || !strings.Contains(err.Error(), "binding of q") {
			t.Errorf("binding %+v: %v, want a refusal of the binding", b, err)
		}
	}
}
