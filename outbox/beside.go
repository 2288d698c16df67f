package outbox

import (
	"context"
	"errors"
	"time"
)

// DefaultDrainTimeout bounds RunBeside's last flush of the outbox.
const DefaultDrainTimeout = 10 * time.Second

// ErrRelayStopped is what RunBeside reports when the relay returned by
// itself, without an error of its own, while the work still ran.
var ErrRelayStopped = errors.New("outbox: the relay stopped")

// RunBeside runs the relay beside work, the code that fills its outbox (a
// consumer, an HTTP server), in one process and under one context, so that
// neither outlives the other:
//
//   - the relay starts first, then work runs with a context that ends with
//     ctx or when the relay stops by itself (a broker that refuses its
//     credentials, a schema not migrated: what retrying does not heal), so
//     that the process does not go on filling an outbox nobody publishes;
//   - when work returns nil, the relay keeps publishing until the outbox has
//     no pending row or drainTimeout passes (0: DefaultDrainTimeout; rows
//     left behind are published by the next relay to run: none is lost);
//     then it stops;
//   - when work returns an error, the relay stops at once.
//
// RunBeside returns work's error joined with the relay's (ErrRelayStopped
// when the relay stopped by itself without one).
func (r *Relay) RunBeside(ctx context.Context, drainTimeout time.Duration, work func(ctx context.Context) error) error {
	if drainTimeout <= 0 {
		drainTimeout = DefaultDrainTimeout
	}
	relayCtx, stopRelay := context.WithCancel(context.WithoutCancel(ctx))
	defer stopRelay()
	workCtx, stopWork := context.WithCancel(ctx)
	defer stopWork()
	relayDone := make(chan error, 1)
	go func() {
		err := r.Run(relayCtx)
		gaveUp := relayCtx.Err() == nil
		relayDone <- err // before stopWork: seen once work returns
		if gaveUp {
			stopWork()
		}
	}()

	err := work(workCtx)
	select {
	case rerr := <-relayDone:
		// The relay stopped already: nothing to drain, and its error is why
		// work stopped while ctx is still live.
		if rerr == nil && ctx.Err() == nil {
			rerr = ErrRelayStopped
		}
		return errors.Join(err, rerr)
	default:
	}
	if err == nil {
		r.drain(drainTimeout)
	}
	stopRelay()
	if rerr := <-relayDone; rerr != nil {
		err = errors.Join(err, rerr)
	}
	return err
}

// drain waits, bounded, until the relay's outbox has no pending row.
func (r *Relay) drain(timeout time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		b, err := r.ob.Pending(ctx)
		if err == nil && b.Pending == 0 {
			return
		}
		select {
		case <-ctx.Done():
			r.log.Warn("outbox not empty at shutdown; the next relay to run publishes the rest", "pending", b.Pending)
			return
		case <-tick.C:
		}
	}
}
