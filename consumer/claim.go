package consumer

import (
	"context"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/claim"
	"github.com/idemq/idemq/outbox"
)

// withClaim prepares the handler's context: outbox.Enqueue writes into the
// outbox of the store's schema, and the messages a handler enqueues get ids
// derived from its key (the same on every retry).
func (c *Consumer) withClaim(ctx context.Context, del *Delivery) context.Context {
	ctx = outbox.NewContext(ctx, c.outbox)
	return claim.With(ctx, dedup.Scope{Consumer: c.cfg.Name, Tenant: del.Tenant, Key: del.Key})
}
