// Package relaykit is the seam between package outbox and the crash test
// kit of consumer/consumertest: it lets a test kill a relay after the
// broker confirmed a batch, before the relay marks its rows published. A
// relay that no test set it on never calls a hook.
package relaykit

import "context"

// SetAfterConfirm sets on r, an *outbox.Relay that has not run (typed any:
// this package cannot import outbox, which imports it), the hook a batch
// calls once the broker confirmed every message it published, before the
// rows are marked. When the hook returns true the relay dies there, as a
// process does: the batch's transaction is abandoned (its connection
// closed without COMMIT or ROLLBACK, so Postgres rolls it back and
// releases the rows), nothing is marked, and the lane's broker session is
// closed. The hook should end the relay's context too, or the lane
// reconnects and claims the rows again.
//
// Package outbox sets it when it is initialised.
var SetAfterConfirm func(r any, hook func(ctx context.Context) (crash bool))
