package consumer

import (
	"errors"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/dedup"
)

// TestKeyOf: a key function wins over message_id and the key header; a key
// header that is not a string is an invalid key (FuzzExtractKey, in
// internal/wire, covers the rest of what the publisher wrote).
func TestKeyOf(t *testing.T) {
	d := &amqp.Delivery{MessageId: "from-message-id", Headers: amqp.Table{DefaultKeyHeader: "from-header"}}
	withFunc := identified(t, Config{KeyHeader: DefaultKeyHeader, KeyFunc: func(*amqp.Delivery) string { return "fn" }})
	if k, err := withFunc.keyOf(d); k != "fn" || err != nil {
		t.Fatalf("with a key function: %q, %v; want fn", k, err)
	}
	plain := identified(t, Config{KeyHeader: DefaultKeyHeader})
	if k, err := plain.keyOf(d); k != "from-message-id" || err != nil {
		t.Fatalf("with message_id: %q, %v", k, err)
	}
	d.MessageId = ""
	if k, err := plain.keyOf(d); k != "from-header" || err != nil {
		t.Fatalf("from the header: %q, %v", k, err)
	}
	d.Headers[DefaultKeyHeader] = int64(42)
	if _, err := plain.keyOf(d); !errors.Is(err, dedup.ErrKeyInvalid) {
		t.Fatalf("an integer key header: %v, want ErrKeyInvalid", err)
	}
}

// identified is a consumer of cfg with the identifier New picks.
func identified(t *testing.T, cfg Config) *Consumer {
	t.Helper()
	id, err := newIdentifier(&cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &Consumer{cfg: cfg, identify: id}
}
