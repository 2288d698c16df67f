package wire

import (
	"errors"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/dedup"
)

// The consumer refuses the tenants the HTTP middleware refuses: one rule,
// dedup.ValidateTenant.
func TestReadTenantAppliesTheSharedRule(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("t", 300)
	for _, d := range []*amqp.Delivery{
		{Headers: amqp.Table{"x-tenant-id": long}},
		{UserId: long},
		{Headers: amqp.Table{"x-tenant-id": "acme\x00"}},
	} {
		_, err := ReadTenant(d, "x-tenant-id", d.UserId != "")
		if !errors.Is(err, dedup.ErrTenantInvalid) {
			t.Fatalf("ReadTenant(%+v) = %v, want dedup.ErrTenantInvalid", d.Headers, err)
		}
		if !errors.Is(CheckTenant(long), dedup.ErrTenantInvalid) {
			t.Fatal("CheckTenant accepts a 300-byte tenant")
		}
	}
	if tenant, err := ReadTenant(&amqp.Delivery{Headers: amqp.Table{"x-tenant-id": strings.Repeat("t", MaxTenantLen)}}, "x-tenant-id", false); err != nil || len(tenant) != 255 {
		t.Fatalf("a 255-byte tenant: %d bytes, %v", len(tenant), err)
	}
}
