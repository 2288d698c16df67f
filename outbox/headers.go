package outbox

import (
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/fieldtable"
)

// Headers are stored in headers_amqp as the AMQP field table, in the bytes
// amqp091-go writes on the wire (internal/fieldtable), so that the relay
// publishes exactly what the handler enqueued: every type, strings with NUL
// bytes, names and values that are not UTF-8. See docs/outbox.md.

// encodeHeaders returns the stored form of t, or nil (NULL) for an empty table.
func encodeHeaders(t amqp.Table) ([]byte, error) {
	if len(t) == 0 {
		return nil, nil
	}
	b, err := fieldtable.Encode(t)
	if err != nil {
		return nil, fmt.Errorf("encode headers: %w", err)
	}
	return b, nil
}

// decodeHeaders returns the headers of a row from its headers_amqp, or from
// headers_jsonb for a row written before migration 004; nil when it has none.
func decodeHeaders(table, legacy []byte) (amqp.Table, error) {
	var t amqp.Table
	var err error
	switch {
	case table != nil:
		t, err = fieldtable.Decode(table)
	case legacy != nil:
		t, err = decodeJSONHeaders(legacy)
	}
	if err != nil {
		return nil, fmt.Errorf("decode headers: %w", err)
	}
	return t, nil
}
