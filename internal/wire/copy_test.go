package wire_test

import (
	"fmt"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/wire"
)

func TestReplayCopyDropsTheReason(t *testing.T) {
	d := &amqp.Delivery{MessageId: "k", Body: []byte("b"), ContentType: "text/plain", CorrelationId: "c", Headers: amqp.Table{
		wire.HeaderReason:    "max_attempts_exceeded",
		wire.HeaderError:     "boom",
		wire.HeaderAttempts:  int32(5),
		wire.HeaderAttempt:   int32(1),
		wire.HeaderFirstSeen: "t0",
		"x-delivery-count":   int64(3),
		"x-custom":           "kept",
	}}
	p := wire.ReplayCopy(d)
	if p.MessageId != "k" || string(p.Body) != "b" || p.ContentType != "text/plain" || p.CorrelationId != "c" || p.DeliveryMode != amqp.Persistent {
		t.Errorf("properties: %+v", p)
	}
	want := amqp.Table{wire.HeaderAttempt: int32(1), wire.HeaderFirstSeen: "t0", "x-custom": "kept"}
	if fmt.Sprint(p.Headers) != fmt.Sprint(want) {
		t.Errorf("headers %v, want %v", p.Headers, want)
	}
	if d.Headers[wire.HeaderReason] == nil {
		t.Error("the dead letter's headers were modified")
	}
}

// TestReplayCopyKeepsTheSignature: the replayed copy of a signed dead letter
// still verifies, so that the consumer trusts its tenant and original
// routing key: idemq's own dead letters (x-idemq-attempt 1) and a retry copy
// the broker dead-lettered itself (x-delivery-limit) with its attempt.
func TestReplayCopyKeepsTheSignature(t *testing.T) {
	keys := wire.Keys{{Secret: []byte("a header key of sixteen bytes or more")}}
	for _, attempt := range []int32{1, 3} {
		h := amqp.Table{
			wire.HeaderAttempt: attempt, wire.HeaderTenant: "alice", wire.HeaderOriginalRoutingKey: "orders.created",
			wire.HeaderOriginalExchange: "orders", wire.HeaderFirstSeen: "t0",
		}
		keys.Sign(h, "k", []byte("b"), time.Now())
		h[wire.HeaderReason], h[wire.HeaderError], h[wire.HeaderAttempts] = "permanent_error", "boom", attempt
		p := wire.ReplayCopy(&amqp.Delivery{MessageId: "k", Body: []byte("b"), Headers: h})
		if !keys.Verify(p.Headers, p.MessageId, p.Body) {
			t.Errorf("attempt %d: the replayed copy's signature does not verify: %v", attempt, p.Headers)
		}
	}
}
