package consumer

import (
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/wire"
)

// Headers idemq reads and writes on the copies it publishes (named once, in
// internal/wire). The attempt, the tenant, the first-seen time and the
// original exchange and routing key are trusted only on a copy whose
// HeaderSignature verifies under Config.HeaderKeys; on any other delivery
// every x-idemq-* header is removed before the handler sees it.
const (
	HeaderAttempt          = wire.HeaderAttempt
	HeaderReason           = wire.HeaderReason
	HeaderError            = wire.HeaderError
	HeaderAttempts         = wire.HeaderAttempts
	HeaderFirstSeen        = wire.HeaderFirstSeen
	HeaderOriginalExchange = wire.HeaderOriginalExchange
	HeaderOriginalRouting  = wire.HeaderOriginalRoutingKey
	// HeaderTenant carries the tenant resolved on the first attempt, so that
	// later attempts claim the key in the same scope (copies carry no user_id).
	HeaderTenant = wire.HeaderTenant
	// HeaderSignature is the HMAC that proves idemq wrote the headers above.
	HeaderSignature = wire.HeaderSignature
)

// Headers of a reply, sent to a delivery's reply_to with the stored result
// by its first processing and by every duplicate (docs/consumer.md,
// "Replies"): the outcome ("ok" or "rejected"), the response code (int32)
// and, on a rejection, the reason given to Reject. The body is the response.
const (
	HeaderOutcome        = wire.HeaderOutcome
	HeaderResponseCode   = wire.HeaderResponseCode
	HeaderResponseReason = wire.HeaderResponseReason
)

// keyOf returns the delivery's idempotency key (Consumer.identify). A key
// that cannot be read is an error wrapping dedup.ErrKeyInvalid.
func (c *Consumer) keyOf(d *amqp.Delivery) (string, error) {
	key, _, err := c.identify(d)
	return key, err
}
