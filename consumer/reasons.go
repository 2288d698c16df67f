package consumer

import "github.com/idemq/idemq/internal/wire"

// Reasons returns every reason a dead letter of Q.dlq can be read with, in
// a fixed order: those idemq writes in x-idemq-reason, then those RabbitMQ
// writes in x-death when it dead-letters a message itself (delivery_limit,
// expired, maxlen, rejected), then the reason of a dead letter that names
// none. It is what `idemq dlq replay --reason` accepts.
func Reasons() []string {
	return []string{
		ReasonPermanentError,
		ReasonMaxAttemptsExceeded,
		ReasonKeyRequired,
		ReasonKeyInvalid,
		ReasonKeyReuse,
		ReasonHeadersTooLarge,
		"delivery_limit",
		"expired",
		"maxlen",
		"rejected",
		wire.ReasonUnknown,
	}
}
