// Package relayrun runs an outbox relay beside the work that fills the
// outbox (a forwarding consumer, the HTTP gateway), in one process: the
// relay starts first, and once the work has stopped it keeps publishing
// until the outbox is empty, bounded, so that what the last requests
// committed leaves before the process exits.
package relayrun

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/idemq/idemq/outbox"
)

// Run runs relay until work returns. When work returns nil, the relay goes
// on until ob has no pending row or drainTimeout passes (rows left behind
// are published by the next relay to run: none is lost); then it stops. A
// relay that stops by itself (a broker that refuses its credentials, a
// schema not migrated: what retrying does not heal) ends work's context, so
// that the process does not go on filling an outbox nobody publishes. Run
// returns work's error joined with the relay's.
func Run(ctx context.Context, ob *outbox.Outbox, relay *outbox.Relay, drainTimeout time.Duration, log *slog.Logger, work func(ctx context.Context) error) error {
	relayCtx, stopRelay := context.WithCancel(context.WithoutCancel(ctx))
	defer stopRelay()
	workCtx, stopWork := context.WithCancel(ctx)
	defer stopWork()
	relayDone := make(chan error, 1)
	go func() {
		err := relay.Run(relayCtx)
		gaveUp := relayCtx.Err() == nil
		relayDone <- err // before stopWork: Run sees it once work returns
		if gaveUp {
			stopWork()
		}
	}()

	err := work(workCtx)
	select {
	case rerr := <-relayDone:
		// The relay has stopped already: nothing to drain, and its error
		// is why work stopped when ctx is still live.
		if rerr == nil && ctx.Err() == nil {
			rerr = errors.New("outbox relay stopped")
		}
		return errors.Join(err, rerr)
	default:
	}
	if err == nil {
		drain(ob, drainTimeout, log)
	}
	stopRelay()
	if rerr := <-relayDone; rerr != nil {
		err = errors.Join(err, rerr)
	}
	return err
}

// drain waits, bounded, until the outbox has no pending row.
func drain(ob *outbox.Outbox, timeout time.Duration, log *slog.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		b, err := ob.Pending(ctx)
		if err == nil && b.Pending == 0 {
			return
		}
		select {
		case <-ctx.Done():
			log.Warn("outbox not empty at shutdown; the next relay to run publishes the rest", "pending", b.Pending)
			return
		case <-tick.C:
		}
	}
}
