package wire

import (
	"errors"
	"fmt"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/ordering"
)

// The headers of ordered messages (DESIGN section 12): the publisher's own
// claims, like message_id, so neither x-idemq-* nor signed.
const (
	// HeaderOrderingKey names the entity whose messages take effect in
	// order (an aggregate's id); the partitions' exchange hashes it.
	HeaderOrderingKey = ordering.HeaderKey
	// HeaderSequence is the message's position among its ordering key's,
	// counting from 1 with no gap.
	HeaderSequence = ordering.HeaderSequence
)

// MaxOrderingKeyLen bounds an ordering key, in bytes.
const MaxOrderingKeyLen = 512

// Ordering is what a delivery says of its place in its entity's order.
type Ordering struct {
	// Key is the ordering key; "" when the delivery has none (it is not
	// ordered).
	Key string
	// Sequence is its position (from 1); 0 when it carries none.
	Sequence int64
}

// ErrOrderingInvalid is wrapped by what ReadOrdering refuses.
var ErrOrderingInvalid = errors.New("invalid ordering headers")

// ReadOrdering reads x-ordering-key and x-sequence. An ordering key must be
// text of 1 to MaxOrderingKeyLen bytes of UTF-8; a sequence an integer of
// at least 1 (an AMQP integer of any width, or decimal text: wire.Int), and only
// beside an ordering key.
func ReadOrdering(h amqp.Table) (Ordering, error) {
	var o Ordering
	if v, ok := h[HeaderOrderingKey]; ok {
		k, isText := String(v)
		switch {
		case !isText:
			return o, fmt.Errorf("%w: %s is a %T, not text", ErrOrderingInvalid, HeaderOrderingKey, v)
		case k == "" || len(k) > MaxOrderingKeyLen || !utf8.ValidString(k):
			return o, fmt.Errorf("%w: %s must be 1 to %d bytes of UTF-8", ErrOrderingInvalid, HeaderOrderingKey, MaxOrderingKeyLen)
		}
		o.Key = k
	}
	v, ok := h[HeaderSequence]
	if !ok {
		return o, nil
	}
	n, isInt := Int(v)
	switch {
	case !isInt || n < 1:
		return o, fmt.Errorf("%w: %s must be an integer from 1, not %v", ErrOrderingInvalid, HeaderSequence, v)
	case o.Key == "":
		return o, fmt.Errorf("%w: %s without %s", ErrOrderingInvalid, HeaderSequence, HeaderOrderingKey)
	}
	o.Sequence = n
	return o, nil
}
