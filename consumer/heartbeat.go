package consumer

import (
	"context"
	"errors"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/redact"
)

// ErrHandlerTimeout is the cause of a handler's context that ended at
// HandlerTimeout; the delivery's Event.Err wraps it.
var ErrHandlerTimeout = errors.New("the handler timed out")

// heartbeat keeps the items' leases (dedup.Heartbeat: one statement every
// lease/3) until stopped, and cancels exactly the items whose lease was
// lost (their handler's context ends with a cause wrapping ErrLeaseLost);
// the others go on.
func (c *Consumer) heartbeat(ctx context.Context, items []*item) (stop func()) {
	if c.cfg.Testing.DisableHeartbeat || len(items) == 0 {
		return func() {}
	}
	held := make([]dedup.Held, len(items))
	for i, it := range items {
		held[i] = dedup.Held{Lease: it.lease, Cancel: it.hcancel}
	}
	return dedup.Heartbeat(ctx, c.store, held, dedup.HeartbeatOptions{
		Lease: c.cfg.Lease,
		OnError: func(err error) {
			c.log.Warn("lease heartbeat failed", "err", redact.Error(err))
		},
	})
}
