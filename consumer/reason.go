package consumer

import "github.com/idemq/idemq/internal/wire"

// Reason words: why a message is in a dead-letter queue. They are the values
// of the x-idemq-reason header of a dead letter, of Event.Reason, of the span
// attribute idemq.reason and of the reason label of the dead-letter metric,
// and what `idemq dlq list` shows and `idemq dlq replay --reason` matches.
// The values are a wire format (internal/wire writes and reads them): they
// do not change.
//
// These are the reasons the consumer writes (section 4 of the design).
const (
	// ReasonPermanentError: the handler returned Permanent(err), or the
	// fingerprint could not be computed (an undecodable payload).
	ReasonPermanentError = wire.ReasonPermanentError
	// ReasonMaxAttemptsExceeded: the message failed MaxAttempts times
	// (infrastructure errors, panics, handler timeouts).
	ReasonMaxAttemptsExceeded = wire.ReasonMaxAttemptsExceeded
	// ReasonKeyRequired: the message carries no idempotency key
	// (dedup.ErrKeyRequired).
	ReasonKeyRequired = wire.ReasonKeyRequired
	// ReasonKeyInvalid: the key, or the tenant, is longer than
	// dedup.MaxKeyLen bytes, not valid UTF-8, contains control characters or
	// is not a string (dedup.ErrKeyInvalid).
	ReasonKeyInvalid = wire.ReasonKeyInvalid
	// ReasonKeyReuse: the key was first used for an operation with another
	// fingerprint (dedup.ErrKeyReuse).
	ReasonKeyReuse = wire.ReasonKeyReuse
	// ReasonHeadersTooLarge: no copy of the delivery can carry its headers
	// in one frame of the connection's frame_max, even with idemq's own
	// optional headers dropped and the error text cut. Its dead letter keeps
	// the body and properties; the largest headers are dropped, and
	// x-idemq-error names them.
	ReasonHeadersTooLarge = wire.ReasonHeadersTooLarge
)

// The reasons RabbitMQ gives a message it dead-letters itself, in its x-death
// header, which a dead letter without x-idemq-reason is read by; and the
// reason of a dead letter that carries neither.
const (
	// ReasonDeliveryLimit: the work queue's x-delivery-limit was reached (a
	// message that kept crashing its workers before they could route it).
	ReasonDeliveryLimit = wire.ReasonDeliveryLimit
	// ReasonExpired: the message's TTL ran out in a queue dead-lettering to Q.dlx.
	ReasonExpired = wire.ReasonExpired
	// ReasonMaxLen: a queue's length limit pushed the message out.
	ReasonMaxLen = wire.ReasonMaxLen
	// ReasonRejected: a client rejected the message without requeueing it.
	ReasonRejected = wire.ReasonRejected
	// ReasonUnknown: the dead letter names no reason at all.
	ReasonUnknown = wire.ReasonUnknown
)

// Reasons returns every reason a dead letter of Q.dlq can be read with, in
// a fixed order: those idemq writes in x-idemq-reason, then those RabbitMQ
// writes in x-death when it dead-letters a message itself, then the reason
// of a dead letter that names none. It is what `idemq dlq replay --reason`
// accepts.
func Reasons() []string {
	return []string{
		ReasonPermanentError,
		ReasonMaxAttemptsExceeded,
		ReasonKeyRequired,
		ReasonKeyInvalid,
		ReasonKeyReuse,
		ReasonHeadersTooLarge,
		ReasonSequenceGap,
		ReasonSequenceInvalid,
		ReasonDeliveryLimit,
		ReasonExpired,
		ReasonMaxLen,
		ReasonRejected,
		ReasonUnknown,
	}
}
