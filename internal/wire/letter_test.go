package wire_test

import (
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/wire"
)

func TestReadLetter(t *testing.T) {
	idemq := &amqp.Delivery{MessageId: "k", Body: []byte("xy"), Headers: amqp.Table{
		wire.HeaderReason:             "idempotency_key_reuse",
		wire.HeaderError:              "key reused",
		wire.HeaderAttempts:           int32(2),
		wire.HeaderFirstSeen:          "2026-01-01T00:00:00Z",
		wire.HeaderOriginalExchange:   "in",
		wire.HeaderOriginalRoutingKey: "orders",
		// Tier round trips leave x-death entries: the idemq reason wins.
		"x-death": []any{amqp.Table{"reason": "expired", "queue": "q.retry.1s", "count": int64(1)}},
	}}
	l := wire.ReadLetter(idemq)
	if l.Reason != "idempotency_key_reuse" || l.ByBroker || l.Attempts != 2 || l.Error != "key reused" ||
		l.OriginalExchange != "in" || l.OriginalRoutingKey != "orders" || l.BodySize != 2 || l.MessageID != "k" {
		t.Errorf("idemq dead letter: %+v", l)
	}

	died := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	broker := &amqp.Delivery{MessageId: "k2", Headers: amqp.Table{
		"x-death": []any{
			amqp.Table{"reason": "delivery_limit", "queue": "q", "exchange": "", "routing-keys": []any{"q"}, "count": int64(1), "time": died},
			amqp.Table{"reason": "expired", "queue": "q.retry.1s", "exchange": "", "routing-keys": []any{"q.retry.1s"}, "count": int64(3)},
		},
		"x-first-death-reason": "expired",
	}}
	l = wire.ReadLetter(broker)
	if l.Reason != "delivery_limit" || !l.ByBroker || l.DeathCount != 1 || l.OriginalRoutingKey != "q" || l.DeathTime == nil || !l.DeathTime.Equal(died) {
		t.Errorf("broker dead letter: %+v", l)
	}

	if l = wire.ReadLetter(&amqp.Delivery{}); l.Reason != wire.ReasonUnknown {
		t.Errorf("no reason: %+v", l)
	}
}
