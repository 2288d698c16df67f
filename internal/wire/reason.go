package wire

// The reason words of dead letters: the values of x-idemq-reason, and the
// x-death reasons RabbitMQ writes. They are part of the format: the values do
// not change. The consumer package exports them, with what each means, as
// its Reason* constants; every other package uses those names.
const (
	ReasonPermanentError      = "permanent_error"
	ReasonMaxAttemptsExceeded = "max_attempts_exceeded"
	ReasonKeyRequired         = "idempotency_key_required"
	ReasonKeyInvalid          = "idempotency_key_invalid"
	ReasonKeyReuse            = "idempotency_key_reuse"
	ReasonHeadersTooLarge     = "headers_too_large"
	ReasonSequenceGap         = "sequence_gap"
	ReasonSequenceInvalid     = "sequence_invalid"

	ReasonDeliveryLimit = "delivery_limit"
	ReasonExpired       = "expired"
	ReasonMaxLen        = "maxlen"
	ReasonRejected      = "rejected"
	// ReasonUnknown is the reason of a dead letter that carries none.
	ReasonUnknown = "unknown"
)
