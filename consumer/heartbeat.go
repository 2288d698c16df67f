package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/redact"
)

// ErrHandlerTimeout is the cause of a handler's context that ended at
// HandlerTimeout; the delivery's Event.Err wraps it.
var ErrHandlerTimeout = errors.New("the handler timed out")

// errLeaseLostByBeat is the cause of a handler's context that ended because
// the heartbeat found its lease lost; it wraps dedup.ErrLeaseLost.
var errLeaseLostByBeat = fmt.Errorf("heartbeat: %w", dedup.ErrLeaseLost)

// heartbeat extends the items' leases with one statement every lease/3
// until stopped, and cancels exactly the items whose lease was lost (their
// handler's context ends with ErrLeaseLost as the cause); the others go on.
// Each extend is bounded by the period (the next one takes over), and stop
// cancels the one in flight rather than wait for it.
func (c *Consumer) heartbeat(ctx context.Context, items []*item) (stop func()) {
	if c.cfg.Testing.DisableHeartbeat || len(items) == 0 {
		return func() {}
	}
	live := make([]*dedup.Lease, len(items))
	owner := make(map[*dedup.Lease]*item, len(items))
	for i, it := range items {
		live[i] = it.lease
		owner[it.lease] = it
	}
	period := beatPeriod(items[0].lease)
	ctx, endBeats := context.WithCancel(ctx)
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		t := time.NewTicker(period)
		defer t.Stop()
		for len(live) > 0 {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			bctx, cancel := context.WithTimeout(ctx, period)
			lost, err := c.store.ExtendBatch(bctx, live, c.cfg.Lease)
			cancel()
			if err != nil {
				if ctx.Err() == nil {
					c.log.Warn("lease heartbeat failed", "err", redact.Error(err))
				}
				continue
			}
			for _, l := range lost {
				owner[l].hcancel(errLeaseLostByBeat)
				live = remove(live, l)
			}
		}
	}()
	return func() { endBeats(); <-finished }
}

func remove[T comparable](s []T, v T) []T {
	for i, x := range s {
		if x == v {
			return append(s[:i:i], s[i+1:]...)
		}
	}
	return s
}

// beatPeriod is a third of what is left of the lease (1s if nothing is).
func beatPeriod(l *dedup.Lease) time.Duration {
	if p := time.Until(l.LockedUntil) / 3; p > 0 {
		return p
	}
	return time.Second
}
