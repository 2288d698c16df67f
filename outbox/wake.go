package outbox

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/internal/redact"
)

// How the relays hear of new rows. A NOTIFY inside a transaction takes
// Postgres' database-wide notify lock at COMMIT and holds it through the
// WAL flush, so every transaction that sends one commits alone: such
// commits never group, and one slow flush queues them all. So where the
// commit is not the caller's own (the consumer runtime, the idemhttp
// middleware, or a caller that asked with WakeAfterCommit), the writers
// only note which outboxes they wrote into, and the owner of the commit
// wakes their relays after it, on the pool, through each Outbox's waker.
// A caller that commits its own transaction without asking gets a
// pg_notify inside it, as the insert trigger of schemas before migration
// 014 sent. The relays' poll (RelayConfig.PollInterval) covers a wake-up
// that is lost (a failed NOTIFY, a process that died after its commit).

// wakes is what WakeAfterCommit puts into a context: the outboxes written
// into since the last Wake.
type wakes struct {
	mu  sync.Mutex
	obs []*Outbox
}

func (w *wakes) add(o *Outbox) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !slices.Contains(w.obs, o) {
		w.obs = append(w.obs, o)
	}
}

func (w *wakes) take() []*Outbox {
	w.mu.Lock()
	defer w.mu.Unlock()
	obs := w.obs
	w.obs = nil
	return obs
}

type wakesKey struct{}

// WakeAfterCommit returns a context in which Enqueue, EnqueueBatch and
// Deferred.Write send no NOTIFY in the transaction: they note the outbox
// instead, and Wake(ctx), called after the commit, wakes its relays from
// outside any transaction. Transactions that send no NOTIFY commit side by
// side (Postgres groups their WAL flushes), where those that do commit one
// at a time; the consumer runtime and the idemhttp middleware work this
// way. Call Wake only once the transaction committed: after a rollback
// there is nothing to publish (a Wake then only costs a NOTIFY), and a
// Wake that is never called leaves the rows to the relays' poll
// (RelayConfig.PollInterval, 1 s by default).
func WakeAfterCommit(ctx context.Context) context.Context {
	return context.WithValue(ctx, wakesKey{}, &wakes{})
}

// Wake wakes the relays of the outboxes written into with ctx (see
// WakeAfterCommit) since the last Wake, and forgets them. It does not
// wait: each Outbox sends its NOTIFY on its pool in the background, at most
// one at a time, and folds the wake-ups asked for meanwhile into one more,
// so that N commits cost about one NOTIFY per round trip and the last one
// is always followed by a NOTIFY. A failed NOTIFY is logged at debug level
// and otherwise ignored: the relays' poll finds the rows. Without
// WakeAfterCommit in ctx, Wake does nothing.
func Wake(ctx context.Context) {
	if w := wakesFrom(ctx); w != nil {
		for _, o := range w.take() {
			o.waker.wake()
		}
	}
}

func wakesFrom(ctx context.Context) *wakes {
	w, _ := ctx.Value(wakesKey{}).(*wakes)
	return w
}

// wakeRelays wakes the relays for rows o wrote in tx: after the commit
// when ctx asks for it (WakeAfterCommit), else with a NOTIFY in tx.
func (o *Outbox) wakeRelays(ctx context.Context, tx pgx.Tx) error {
	if w := wakesFrom(ctx); w != nil {
		w.add(o)
		return nil
	}
	if _, err := tx.Exec(ctx, "SELECT pg_notify($1, '')", o.channel); err != nil {
		return fmt.Errorf("notify the relays: %w", err)
	}
	return nil
}

// wakeStatement is a waker's NOTIFY, $1 the channel. It is a transaction
// of its own, which Postgres gives an id and commits with a WAL flush
// under the notify lock; committed asynchronously (synchronous_commit off
// for it alone), it holds the lock for no flush. Only the wake-up is at
// stake, not the rows: a crash can lose it, and the relays' poll covers
// that as any lost wake-up.
const wakeStatement = "SELECT set_config('synchronous_commit', 'off', true), pg_notify($1, '')"

// notifyTimeout bounds one NOTIFY of a waker.
const notifyTimeout = 10 * time.Second

// waker sends an outbox's NOTIFY after commits: at most one in flight, and
// the requests that come while one is in flight make exactly one more, sent
// after it (a NOTIFY that started before a commit may reach the relays
// before the commit is visible to them).
type waker struct {
	notify func(context.Context) error

	mu      sync.Mutex
	running bool // a NOTIFY is in flight
	again   bool // and another was asked for since it started
}

// wake asks for a NOTIFY after this call, without waiting for it.
func (w *waker) wake() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.running {
		w.again = true
		return
	}
	w.running = true
	go w.run()
}

// run sends NOTIFYs until none was asked for during the last one.
func (w *waker) run() {
	for {
		ctx, cancel := context.WithTimeout(context.Background(), notifyTimeout)
		if err := w.notify(ctx); err != nil {
			slog.Debug("outbox: wake the relays (their poll will find the rows)", "err", redact.Error(err))
		}
		cancel()
		w.mu.Lock()
		if !w.again {
			w.running = false
			w.mu.Unlock()
			return
		}
		w.again = false
		w.mu.Unlock()
	}
}
