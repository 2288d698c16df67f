package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/wire"
)

// configuredKeys are Config.HeaderKeys as signing keys: the first signs.
func configuredKeys(secrets [][]byte) wire.Keys {
	ks := make(wire.Keys, len(secrets))
	for i, s := range secrets {
		ks[i] = wire.Key{Secret: s}
	}
	return ks
}

// headerKeys returns the keys that sign and verify idemq's headers:
// Config.HeaderKeys, else those of the store's schema, bound to this
// consumer's queue and name (wire.Keys.For): its copies are trusted by it
// alone, not by a stage that finds one in its own queue. A schema without
// keys is a fatal error (it needs `idemq migrate`).
func (c *Consumer) headerKeys(ctx context.Context) (wire.Keys, error) {
	if c.cfg.HeaderKeys != nil {
		return configuredKeys(c.cfg.HeaderKeys).For(c.cfg.Queue, c.cfg.Name), nil
	}
	ctx, cancel := context.WithTimeout(ctx, settleTimeout)
	defer cancel()
	stored, err := c.protocol.HeaderKeys(ctx)
	if errors.Is(err, dedup.ErrNotMigrated) {
		return nil, &fatalError{fmt.Errorf("%w (run idemq migrate)", err)}
	}
	if err != nil {
		return nil, err
	}
	ks := make(wire.Keys, len(stored))
	for i, k := range stored {
		ks[i] = wire.Key{Secret: k.Secret, SignsFrom: k.SignsFrom}
	}
	if err := ks.Validate(); err != nil {
		return nil, &fatalError{fmt.Errorf("table %s.header_keys: %w", c.store.Config().Schema, err)}
	}
	return ks.For(c.cfg.Queue, c.cfg.Name), nil
}

// trust reports whether d is a copy idemq wrote for this consumer: its
// signature verifies for the consumer's queue and name.
// From any other delivery it removes every x-idemq-* header, so that
// nothing reads, forwards or copies what its publisher wrote there.
func (c *Consumer) trust(d *amqp.Delivery) bool {
	if c.keys.Verify(d.Headers, d.MessageId, d.Body) {
		return true
	}
	d.Headers = wire.Strip(d.Headers)
	return false
}

// tenantOf returns the delivery's tenant: the one a verified copy carries
// (resolved by its first attempt), else the configured source's.
func (c *Consumer) tenantOf(d *amqp.Delivery, verified bool) (string, error) {
	if t, ok := wire.String(d.Headers[HeaderTenant]); ok && verified {
		return t, wire.CheckTenant(t)
	}
	return wire.ReadTenant(d, c.cfg.TenantHeader, c.cfg.TenantFromUserID)
}

// replacement is the signed copy that replaces d, with extra headers and
// the tenant ev resolved: every later attempt claims the key in the same
// scope, although the copy has no user_id.
func (c *Consumer) replacement(d *amqp.Delivery, ev Event, extra amqp.Table) amqp.Publishing {
	if ev.scoped {
		extra[HeaderTenant] = ev.Tenant
	}
	return wire.Copy(d, time.Now(), extra, c.keys)
}
