package forward_test

import (
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/cmd/idemq/internal/forward"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/wire"
)

func TestMessageKeepsContentAndDropsPathHeaders(t *testing.T) {
	d := &consumer.Delivery{
		Key:         "k-1",
		MessageID:   "k-1",
		Body:        []byte(`{"a":1}`),
		ContentType: "application/json",
		RoutingKey:  "orders",
		// As the consumer read it from its signed copy.
		OriginalRoutingKey: "orders.created",
		Headers: amqp.Table{
			"x-custom":                    "kept",
			"Idempotency-Key":             "k-1",
			"x-tenant-id":                 "acme",
			"x-number":                    int32(7),
			wire.HeaderAttempt:            int32(3),
			wire.HeaderFirstSeen:          "2026-01-01T00:00:00Z",
			wire.HeaderOriginalExchange:   "",
			wire.HeaderOriginalRoutingKey: "orders.created",
			"x-death":                     []any{amqp.Table{"reason": "expired"}},
			"x-first-death-reason":        "expired",
			"x-delivery-count":            int64(2),
			"traceparent":                 "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
			"tracestate":                  "a=b",
		},
		CorrelationID: "c-1",
	}
	m := forward.Message(d, "out", "")
	if m.Exchange != "out" || m.RoutingKey != "orders.created" || m.MessageID != "k-1" ||
		string(m.Body) != `{"a":1}` || m.ContentType != "application/json" || m.CorrelationID != "c-1" {
		t.Fatalf("message: %+v", m)
	}
	want := amqp.Table{"x-custom": "kept", "Idempotency-Key": "k-1", "x-tenant-id": "acme", "x-number": int32(7)}
	if len(m.Headers) != len(want) {
		t.Fatalf("headers: %v, want %v", m.Headers, want)
	}
	for k, v := range want {
		if m.Headers[k] != v {
			t.Errorf("header %s = %v, want %v", k, m.Headers[k], v)
		}
	}
	if d.Headers[wire.HeaderAttempt] == nil {
		t.Error("the delivery's own headers were modified")
	}
}

func TestMessageIDFallsBackToTheKeyAndRoutingKeyToTheOriginal(t *testing.T) {
	d := &consumer.Delivery{Key: "from-header", RoutingKey: "rk", OriginalRoutingKey: "rk", Headers: amqp.Table{"Idempotency-Key": "from-header"}}
	m := forward.Message(d, "", "")
	if m.MessageID != "from-header" || m.RoutingKey != "rk" {
		t.Fatalf("message: %+v", m)
	}
	if m = forward.Message(d, "x", "fixed"); m.RoutingKey != "fixed" {
		t.Fatalf("configured routing key: %+v", m)
	}
	d.Headers = amqp.Table{wire.HeaderAttempt: int32(1)}
	if h := forward.Message(d, "", "").Headers; h != nil {
		t.Fatalf("only idemq headers: want nil, got %v", h)
	}
}
