package interop_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/worker"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/claim"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/outbox"
)

// The CloudEvents a handler enqueues (outbox.CloudEvent, binary and
// structured) are read back by the cloudevents npm package: valid events,
// their id the message id derived from the claim, the same in the
// message_id property, their data the message's body.
func TestNodeReadsOutboxCloudEvents(t *testing.T) {
	t.Parallel()
	modules := installNode(t)
	e := testenv.New(t)
	cfg, events := e.ConsumerConfig("node-out", "charge")
	x, sink := testamqp.Name(t, "node-out-x"), testamqp.Name(t, "node-out-sink")
	testamqp.Sink(t, e.Pub, x, amqp.ExchangeFanout, sink, "")
	testamqp.DeleteQueuesAtCleanup(t, []string{sink}, []string{x})

	charged := outbox.CloudEvent{Source: "/idemq/payments", Type: "com.example.payment.charged", Subject: "order-7"}
	structured := charged
	structured.Structured = true
	w, err := worker.New(e.Store, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		err := outbox.EnqueueBatch(ctx, tx, []outbox.Message{
			{Exchange: x, ContentType: "application/json", Body: d.Body, Format: charged},
			{Exchange: x, ContentType: "application/json", Body: d.Body, Format: structured},
		})
		return consumer.Response{Code: 200}, err
	}, &worker.Config{Consumer: cfg})
	if err != nil {
		t.Fatal(err)
	}
	e.RunFunc(w.Run)
	e.Publish(cfg.Queue, "pay-1", `{"orderId":7,"amount":42}`, nil)
	testenv.WaitOutcome(t, events, consumer.OutcomeProcessed)

	got := decodeEvents(t, node(t, modules, sink, "read", "2"))
	if len(got) != 2 {
		t.Fatalf("node read %d events, want 2", len(got))
	}
	scope := dedup.Scope{Consumer: cfg.Name, Key: "pay-1"}
	ids := map[string]bool{claim.MessageID(scope, "", 1): true, claim.MessageID(scope, "", 2): true}
	for _, ev := range got {
		if !ids[ev.ID] || ev.MessageID != ev.ID {
			t.Errorf("event id %q, message_id %q; want one of the derived ids %v", ev.ID, ev.MessageID, ids)
		}
		delete(ids, ev.ID)
		if ev.SpecVersion != "1.0" || ev.Source != charged.Source || ev.Type != charged.Type {
			t.Errorf("event %+v", ev)
		}
		if string(ev.Data) != `{"orderId":7,"amount":42}` {
			t.Errorf("event %s: data %s", ev.ID, ev.Data)
		}
	}
}
