package consumer

import (
	"context"

	"github.com/idemq/idemq/outbox"
)

// withClaim prepares the handler's context: outbox.Enqueue reads the claim
// from it, so that the messages a handler enqueues get ids derived from its
// key (the same on every retry) and land in the store's schema.
func (c *Consumer) withClaim(ctx context.Context, del *Delivery) context.Context {
	return outbox.WithClaim(ctx, outbox.Claim{
		Schema:   c.store.Config().Schema,
		Consumer: c.cfg.Name,
		Tenant:   del.Tenant,
		Key:      del.Key,
	})
}
