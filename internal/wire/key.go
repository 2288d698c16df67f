package wire

import (
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/dedup"
)

// MaxTenantLen bounds a tenant, in bytes: dedup.MaxTenantLen.
const MaxTenantLen = dedup.MaxTenantLen

// ReadKey returns the delivery's idempotency key as its publisher wrote it: the
// message_id property, else the header keyHeader (text), else "". A key
// header that is present but not text (an AMQP integer, a table, a void
// value) is an error. The key itself is not validated here.
func ReadKey(d *amqp.Delivery, keyHeader string) (string, error) {
	if d.MessageId != "" {
		return d.MessageId, nil
	}
	v, present := d.Headers[keyHeader]
	if !present {
		return "", nil
	}
	k, ok := String(v)
	if !ok {
		return "", fmt.Errorf("key header %s is a %T, not a string", keyHeader, v)
	}
	return k, nil
}

// ReadTenant returns the delivery's tenant: the user_id property when
// fromUserID, else the header tenantHeader ("" when absent). A tenant that
// is not text, or that CheckTenant refuses, is an error. (A consumer reads it
// so only from deliveries that are not idemq's verified copies: those carry
// the tenant in HeaderTenant.)
func ReadTenant(d *amqp.Delivery, tenantHeader string, fromUserID bool) (string, error) {
	var tenant string
	if fromUserID {
		tenant = d.UserId
	} else if v, present := d.Headers[tenantHeader]; present {
		s, ok := String(v)
		if !ok {
			return "", fmt.Errorf("tenant header %s is a %T, not a string", tenantHeader, v)
		}
		tenant = s
	}
	return tenant, CheckTenant(tenant)
}

// CheckTenant applies dedup.ValidateTenant, the one tenant rule of every
// door (the HTTP middleware applies it too): a tenant longer than
// MaxTenantLen bytes, not UTF-8 or holding control characters is refused
// with an error that wraps dedup.ErrTenantInvalid.
func CheckTenant(tenant string) error {
	if err := dedup.ValidateTenant(tenant); err != nil {
		return fmt.Errorf("check tenant: %w", err)
	}
	return nil
}

// Origin is where d was first published: as the signed headers of a copy
// record it, else d's own exchange and routing key. Call it only on a
// delivery whose signature verified, or whose idemq headers were stripped.
func Origin(d *amqp.Delivery) (exchange, routingKey string) {
	exchange, routingKey = d.Exchange, d.RoutingKey
	if v, ok := String(d.Headers[HeaderOriginalExchange]); ok {
		exchange = v
	}
	if v, ok := String(d.Headers[HeaderOriginalRoutingKey]); ok {
		routingKey = v
	}
	return exchange, routingKey
}
