package wire

import (
	"maps"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Copy builds the publishing that replaces d in a retry tier or the DLQ: its
// body, properties and all its headers kept, plus extra headers
// (RetryHeaders, DeadLetterHeaders, the tenant), signed with keys. The
// original exchange, routing key and first-seen time are set on the first
// copy and kept on later ones. The copy carries no user_id: RabbitMQ refuses
// a user_id other than the publishing connection's user, and the worker's is
// not the publisher's (the tenant taken from it travels in HeaderTenant).
// Nor does it carry d's expiration: a dead letter must not expire in the
// DLQ, and a retry waits for its tier's delay.
func Copy(d *amqp.Delivery, now time.Time, extra amqp.Table, keys Keys) amqp.Publishing {
	h := make(amqp.Table, len(d.Headers)+len(extra)+4)
	maps.Copy(h, d.Headers)
	if _, ok := h[HeaderOriginalExchange]; !ok {
		h[HeaderOriginalExchange] = d.Exchange
		h[HeaderOriginalRoutingKey] = d.RoutingKey
	}
	if _, ok := h[HeaderFirstSeen]; !ok {
		h[HeaderFirstSeen] = now.UTC().Format(time.RFC3339Nano)
	}
	delete(h, HeaderWaitingSince) // only the copy of a waiting message has it
	maps.Copy(h, extra)
	keys.Sign(h, d.MessageId, d.Body, now)
	return publishing(d, h)
}

// replayDropped are the headers a replayed dead letter leaves behind: the
// description of its death, and the broker's delivery count.
var replayDropped = []string{HeaderReason, HeaderError, HeaderAttempts, HeaderDeliveryCount}

// ReplayCopy builds the publishing that moves dead letter d back to its work
// queue: the body, the properties (user_id and expiration included),
// message_id and the headers, except x-idemq-reason, x-idemq-error,
// x-idemq-attempts and x-delivery-count. Its user_id, which only a dead
// letter the broker made carries, is its publisher's: whoever publishes the
// copy checks UserIDAllowed first, and drops it or keeps the letter. It keeps idemq's signed headers as
// they are, so that their signature still verifies and the consumer keeps
// the tenant and the original exchange and routing key: idemq dead-letters
// with x-idemq-attempt 1 (a full retry budget); a retry copy the broker
// dead-lettered itself keeps its attempt; an unsigned dead letter is a first
// attempt anyway.
func ReplayCopy(d *amqp.Delivery) amqp.Publishing {
	h := maps.Clone(d.Headers)
	if h == nil {
		h = amqp.Table{}
	}
	for _, k := range replayDropped {
		delete(h, k)
	}
	p := publishing(d, h)
	p.Expiration, p.UserId = d.Expiration, d.UserId
	return p
}

// UserIDAllowed reports whether a connection authenticated as user may
// publish a message with userID: RabbitMQ accepts a user_id only equal to
// the connection's user (unless that user has the impersonator tag, which
// idemq does not ask about) and closes the channel of any other publish
// (PRECONDITION_FAILED). An empty userID is always allowed; an unknown user
// (user "": a certificate login) allows no other.
func UserIDAllowed(userID, user string) bool {
	return userID == "" || (user != "" && userID == user)
}

// publishing is d's body and properties with headers h, persistent, without
// expiration and user_id.
func publishing(d *amqp.Delivery, h amqp.Table) amqp.Publishing {
	return amqp.Publishing{
		Headers:         h,
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    amqp.Persistent,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		MessageId:       d.MessageId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		AppId:           d.AppId,
		Body:            d.Body,
	}
}

// ForwardHeaders returns the headers a forwarding stage passes on: all of h
// except those that describe the message's path through the stage rather
// than the message: idemq's own x-idemq-*, the broker's x-death,
// x-first-death-*, x-last-death-* and x-delivery-count, and the trace
// context (the stage's publisher writes its own). Nil when none is left.
func ForwardHeaders(h amqp.Table) amqp.Table {
	out := make(amqp.Table, len(h))
	for k, v := range h {
		if !onPath(k) {
			out[k] = v
		}
	}
	if len(out) == 0 {
		return nil
	}
	return out
}

// onPath reports whether header name describes a message's path (any case).
func onPath(name string) bool {
	n := strings.ToLower(name)
	return IsIdemq(n) || n == HeaderDeath || n == HeaderDeliveryCount ||
		strings.HasPrefix(n, FirstDeathPrefix) || strings.HasPrefix(n, LastDeathPrefix) ||
		n == HeaderTraceparent || n == HeaderTracestate
}
