package wire

import (
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Letter is what a dead letter says about itself (idemq dlq list prints it,
// with these JSON names, every one always present: docs/cli.md lists them).
type Letter struct {
	MessageID string `json:"message_id"`
	// Reason is x-idemq-reason, else the latest x-death reason, else ReasonUnknown.
	Reason string `json:"reason"`
	// ByBroker reports that the broker dead-lettered the message itself
	// (the reason comes from x-death).
	ByBroker bool `json:"by_broker"`
	// Attempts is x-idemq-attempts: how many times the message was handled.
	Attempts int `json:"attempts"`
	// FirstSeen is x-idemq-first-seen: when idemq first saw the message.
	FirstSeen string `json:"first_seen"`
	// Error is x-idemq-error: the failure's text, truncated.
	Error string `json:"error"`
	// OriginalExchange and OriginalRoutingKey say where the message was first
	// published (x-idemq-original-*, else the latest x-death entry).
	OriginalExchange   string `json:"original_exchange"`
	OriginalRoutingKey string `json:"original_routing_key"`
	// DeathCount is the count of the latest x-death entry (broker dead-lettering).
	DeathCount  int64  `json:"death_count"`
	ContentType string `json:"content_type"`
	BodySize    int    `json:"body_size"`
	// Timestamp is the message's timestamp property; nil when it has none.
	Timestamp *time.Time `json:"timestamp"`
	// DeathTime is the time of the latest x-death entry (when the broker
	// first dead-lettered the message from that queue for that reason);
	// nil when it has none.
	DeathTime *time.Time `json:"death_time,omitempty"`
}

// ReadLetter reads what dead letter d says: the x-idemq-* description idemq
// wrote on it, else, for a message the broker dead-lettered itself (the work
// queue's x-delivery-limit, a TTL, a length limit), the reason of the latest
// x-death entry: delivery_limit, expired, maxlen or rejected.
func ReadLetter(d *amqp.Delivery) Letter {
	h := d.Headers
	text := func(v any) string { s, _ := String(v); return s }
	attempts, _ := Int(h[HeaderAttempts])
	l := Letter{
		MessageID:          d.MessageId,
		Reason:             text(h[HeaderReason]),
		Attempts:           int(attempts),
		FirstSeen:          text(h[HeaderFirstSeen]),
		Error:              text(h[HeaderError]),
		OriginalExchange:   text(h[HeaderOriginalExchange]),
		OriginalRoutingKey: text(h[HeaderOriginalRoutingKey]),
		ContentType:        d.ContentType,
		BodySize:           len(d.Body),
	}
	if !d.Timestamp.IsZero() {
		ts := d.Timestamp
		l.Timestamp = &ts
	}
	_, hasOrigin := h[HeaderOriginalExchange]
	if death, ok := latestDeath(h); ok {
		if t, ok := death["time"].(time.Time); ok && !t.IsZero() {
			l.DeathTime = &t
		}
		if l.Reason == "" {
			l.Reason = text(death["reason"])
			l.ByBroker = l.Reason != ""
			l.DeathCount, _ = Int(death["count"])
		}
		if !hasOrigin {
			l.OriginalExchange = text(death["exchange"])
			if keys, ok := death["routing-keys"].([]any); ok && len(keys) > 0 {
				l.OriginalRoutingKey = text(keys[0])
			}
		}
	}
	if l.Reason == "" {
		for _, k := range []string{LastDeathPrefix + "reason", FirstDeathPrefix + "reason"} {
			if r := text(h[k]); r != "" {
				l.Reason, l.ByBroker = r, true
				break
			}
		}
	}
	if l.Reason == "" {
		l.Reason = ReasonUnknown
	}
	return l
}

// Label is the reason as a report counts it: idemq's reasons as they are,
// the broker's marked as such (broker:delivery_limit).
func (l Letter) Label() string {
	if l.ByBroker {
		return "broker:" + l.Reason
	}
	return l.Reason
}

// latestDeath is the first (most recent) entry of x-death.
func latestDeath(h amqp.Table) (amqp.Table, bool) {
	deaths, ok := h[HeaderDeath].([]any)
	if !ok || len(deaths) == 0 {
		return nil, false
	}
	t, ok := deaths[0].(amqp.Table)
	return t, ok
}
