package dedup

import (
	"cmp"
	"context"
	"fmt"
	"sync"
	"time"
)

// errLostByHeartbeat is the cause Heartbeat cancels a lost lease's context
// with.
var errLostByHeartbeat = fmt.Errorf("heartbeat: %w", ErrLeaseLost)

// Held is a lease a heartbeat keeps, with the cancel of the context of the
// work that holds it.
type Held struct {
	Lease *Lease
	// Cancel ends the holder's context when the lease is found lost, with a
	// cause that wraps ErrLeaseLost.
	Cancel context.CancelCauseFunc
}

// HeartbeatOptions tune Heartbeat. The zero value extends by the store's
// lease.
type HeartbeatOptions struct {
	// Lease is how far each beat extends the leases (0: the store's Lease).
	// The beats come every third of it.
	Lease time.Duration
	// OnError is told of a beat that failed for another reason than a lost
	// lease (the database out of reach); the next beat tries again. Nil:
	// not told.
	OnError func(error)
}

// Heartbeat keeps leases valid while the work that holds them runs: every
// third of the lease (sooner when one has less left) it extends all of
// them with one statement on the store's pool, a connection of its own, and
// when a lease is found lost (taken over, released, completed) it calls
// that lease's Cancel with a cause that wraps ErrLeaseLost and extends it no
// more; the others go on. Each beat is bounded by the period. Leases held by
// a transaction (HeldByTransaction) need no heartbeat and are left out.
//
// It runs until ctx ends or stop is called; stop cancels the beat in flight
// rather than wait for it, returns once the heartbeat has ended, and is safe
// to call more than once. Stopping never cancels a holder: call stop before
// completing or releasing the leases.
func Heartbeat(ctx context.Context, s *Store, held []Held, o HeartbeatOptions) (stop func()) {
	d := cmp.Or(max(o.Lease, 0), s.cfg.Lease)
	live := make([]*Lease, 0, len(held))
	owner := make(map[*Lease]context.CancelCauseFunc, len(held))
	for _, h := range held {
		if h.Lease == nil || h.Lease.held {
			continue
		}
		live = append(live, h.Lease)
		owner[h.Lease] = h.Cancel
	}
	if len(live) == 0 {
		return func() {}
	}
	period := beatPeriod(live, d)
	ctx, end := context.WithCancel(ctx)
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
			lost, err := (*keys)(s).ExtendBatch(bctx, live, d)
			cancel()
			if err != nil {
				if ctx.Err() == nil && o.OnError != nil {
					o.OnError(err)
				}
				continue
			}
			for _, l := range lost {
				if c := owner[l]; c != nil {
					c(errLostByHeartbeat)
				}
				live = without(live, l)
			}
		}
	}()
	var once sync.Once
	return func() { once.Do(func() { end(); <-finished }) }
}

// beatPeriod is a third of the lease, or of the time the first lease to
// expire has left when that is less (a second if none is left).
func beatPeriod(leases []*Lease, d time.Duration) time.Duration {
	left := d
	for _, l := range leases {
		if !l.LockedUntil.IsZero() {
			left = min(left, time.Until(l.LockedUntil))
		}
	}
	if left <= 0 {
		return min(time.Second, d/3)
	}
	return max(left/3, time.Millisecond)
}

// without is s less v (a copy: s is left as it was).
func without(s []*Lease, v *Lease) []*Lease {
	for i, x := range s {
		if x == v {
			return append(s[:i:i], s[i+1:]...)
		}
	}
	return s
}
