package consumer_test

import (
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/wire"
)

// BenchmarkPrepare measures the per-delivery work before the database:
// key and tenant extraction, key validation, the key hash and the fingerprint.
func BenchmarkPrepare(b *testing.B) {
	d := &amqp.Delivery{
		MessageId: "order-2026-11-30-000042-charge",
		Headers:   amqp.Table{"x-tenant-id": "acme", consumer.HeaderAttempt: int32(2)},
		Body:      []byte(`{"account":"A-1","amount":4200,"currency":"EUR","note":"monthly subscription"}`),
	}
	b.ReportAllocs()
	for b.Loop() {
		key, err := wire.ReadKey(d, consumer.DefaultKeyHeader)
		if err != nil {
			b.Fatal(err)
		}
		if err := dedup.ValidateKey(key); err != nil {
			b.Fatal(err)
		}
		tenant, err := wire.ReadTenant(d, consumer.DefaultTenantHeader, false)
		if err != nil {
			b.Fatal(err)
		}
		_ = wire.ParseAttempt(d.Headers)
		_ = dedup.Scope{Consumer: "payments", Tenant: tenant, Key: key}.KeyHash()
		if _, err := dedup.BodyFingerprint(d.Body); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkExtractKey measures reading the key from its header.
func BenchmarkExtractKey(b *testing.B) {
	d := &amqp.Delivery{Headers: amqp.Table{consumer.DefaultKeyHeader: []byte("order-2026-11-30-000042")}}
	b.ReportAllocs()
	for b.Loop() {
		if k, err := wire.ReadKey(d, consumer.DefaultKeyHeader); k == "" || err != nil {
			b.Fatal("no key")
		}
	}
}
