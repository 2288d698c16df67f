package outbox_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
)

// wakeBound is how long a relay that polls once a minute may take to
// publish a committed row: only a wake-up gets it there in time.
const wakeBound = 10 * time.Second

// sleepyRelay starts a relay of e that polls once a minute, so that a row
// it publishes within wakeBound was woken for, and drops any insert
// trigger of the outbox table (an old schema's), so that the wake-up can
// only come from the writer. It returns once the relay's LISTEN heard its
// probe, with the notifications of the channel from then on.
func (e *env) sleepyRelay(t *testing.T) <-chan string {
	t.Helper()
	if _, err := e.pool.Exec(context.Background(), "DROP TRIGGER IF EXISTS outbox_notify ON "+pgx.Identifier{e.schema, "outbox"}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	heard := e.listen(t)
	cfg := e.relayConfig(t)
	cfg.PollInterval = time.Minute
	e.startRelay(t, cfg)
	for !strings.HasPrefix(next(t, heard), "idemq-listen-probe-") {
	}
	return heard
}

// each commits n messages one after the other with write, waiting after
// each for its delivery within wakeBound: the relay's start may pick up the
// first by its own claim, never the others.
func (e *env) each(t *testing.T, n int, write func(ctx context.Context, msg outbox.Message) error) {
	t.Helper()
	deliveries := e.consumer(t)
	for i := range n {
		id := fmt.Sprintf("wake-%d", i)
		start := time.Now()
		if err := write(context.Background(), outbox.Message{Exchange: e.exchange, RoutingKey: boundKey, MessageID: id}); err != nil {
			t.Fatalf("write %s: %v", id, err)
		}
		select {
		case d := <-deliveries:
			if d.MessageId != id {
				t.Fatalf("got %s, want %s", d.MessageId, id)
			}
			t.Logf("%s published %s after its commit", id, time.Since(start).Round(time.Millisecond))
		case <-time.After(wakeBound):
			t.Fatalf("%s not published within %s of its commit: the relay was not woken", id, wakeBound)
		}
	}
}

// A writer that commits its own transaction wakes the relays as the
// trigger did, from inside the transaction, at its commit.
func TestEnqueueInOwnTransactionWakesTheRelay(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 6)
	heard := e.sleepyRelay(t)
	e.each(t, 5, func(ctx context.Context, msg outbox.Message) error {
		err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return e.ob.Enqueue(ctx, tx, msg) })
		if err == nil && next(t, heard) != "" { // sent at COMMIT, before Enqueue returned
			t.Fatal("the commit's notification is not the next one")
		}
		return err
	})
}

func TestEnqueueBatchInOwnTransactionWakesTheRelay(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 6)
	e.sleepyRelay(t)
	e.each(t, 5, func(ctx context.Context, msg outbox.Message) error {
		return pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return e.ob.EnqueueBatch(ctx, tx, []outbox.Message{msg}) })
	})
}

// WakeAfterCommit moves the wake-up after the commit: nothing is sent in
// the transaction, and Wake sends it.
func TestWakeAfterCommitWakesTheRelay(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 6)
	e.sleepyRelay(t)
	e.each(t, 5, func(ctx context.Context, msg outbox.Message) error {
		ctx = outbox.WakeAfterCommit(ctx)
		if err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return e.ob.Enqueue(ctx, tx, msg) }); err != nil {
			return err
		}
		outbox.Wake(ctx)
		return nil
	})
}

// A Deferred's rows wake the relays in the transaction, unless the context
// of Write asks for the wake-up after the commit.
func TestDeferredWakesTheRelay(t *testing.T) {
	t.Parallel()
	for _, after := range []bool{false, true} {
		t.Run("after commit="+strconv.FormatBool(after), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, 6)
			e.sleepyRelay(t)
			e.each(t, 5, func(ctx context.Context, msg outbox.Message) error {
				if after {
					ctx = outbox.WakeAfterCommit(ctx)
				}
				err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
					d := outbox.NewDeferred(tx)
					if err := e.ob.Enqueue(outbox.WithDeferred(ctx, d), tx, msg); err != nil {
						return err
					}
					return d.Write(ctx, tx)
				})
				if err == nil {
					outbox.Wake(ctx)
				}
				return err
			})
		})
	}
}

// listen returns the notifications of the env's outbox channel, in the
// order Postgres delivers them (commit order), until the test ends.
func (e *env) listen(t *testing.T) <-chan string {
	t.Helper()
	return testdb.Listen(t, outbox.ChannelName(e.schema))
}

// sentinel sends a notification with payload p on the env's channel,
// outside any transaction: every notification of a transaction committed
// before it arrives before it.
func (e *env) sentinel(t *testing.T, p string) {
	t.Helper()
	if _, err := e.pool.Exec(context.Background(), "SELECT pg_notify($1, $2)", outbox.ChannelName(e.schema), p); err != nil {
		t.Fatal(err)
	}
}

// next returns the next notification, failing after wakeBound.
func next(t *testing.T, heard <-chan string) string {
	t.Helper()
	select {
	case p := <-heard:
		return p
	case <-time.After(wakeBound):
		t.Fatalf("no notification within %s", wakeBound)
		return ""
	}
}

// A rolled-back transaction notifies no one and publishes nothing, with or
// without WakeAfterCommit.
func TestRolledBackEnqueueWakesNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 6)
	heard := e.listen(t)
	ctx := context.Background()
	wctx := outbox.WakeAfterCommit(ctx)
	for _, c := range []context.Context{ctx, wctx} {
		tx, err := e.pool.Begin(c)
		if err != nil {
			t.Fatal(err)
		}
		if err := e.ob.Enqueue(c, tx, outbox.Message{Exchange: e.exchange, RoutingKey: boundKey, MessageID: "rolled-back"}); err != nil {
			t.Fatal(err)
		}
		if err := e.ob.EnqueueBatch(c, tx, []outbox.Message{{Exchange: e.exchange, RoutingKey: boundKey, MessageID: "rolled-back"}}); err != nil {
			t.Fatal(err)
		}
		if err := tx.Rollback(c); err != nil {
			t.Fatal(err)
		}
	}
	// wctx's Wake is not called: the caller calls it after a commit only.
	e.sentinel(t, "after")
	if p := next(t, heard); p != "after" {
		t.Fatalf("first notification %q: a rolled-back transaction notified", p)
	}
	if b := e.backlog(t); b.Pending != 0 {
		t.Fatalf("backlog %+v after rollbacks", b)
	}
}

// Many writers committing at once with WakeAfterCommit: every message is
// published promptly, a NOTIFY follows the last commit, and the NOTIFYs
// are coalesced (never more than one per wake request).
func TestWakeAfterCommitCoalesces(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 20)
	heard := e.sleepyRelay(t)
	c := e.collect(t)
	const writers, each = 16, 20
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				ctx := outbox.WakeAfterCommit(context.Background())
				msg := outbox.Message{Exchange: e.exchange, RoutingKey: boundKey, MessageID: fmt.Sprintf("w%d-%d", w, i)}
				if err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return e.ob.Enqueue(ctx, tx, msg) }); err != nil {
					errs <- err
					return
				}
				outbox.Wake(ctx)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	waitFor(t, wakeBound, "every message published", func() bool {
		distinct, _ := c.counts()
		return distinct == writers*each
	})
	// Every commit is done: a NOTIFY still comes after the last of them
	// (the last wake request's), then the sentinel.
	e.sentinel(t, "end")
	n := 0
	for p := next(t, heard); p != "end"; p = next(t, heard) {
		if p == "" { // not the relay's LISTEN probe
			n++
		}
	}
	t.Logf("%d commits, %d notifications", writers*each, n)
	if n == 0 || n > writers*each {
		t.Fatalf("%d notifications for %d commits", n, writers*each)
	}
}

// With WakeAfterCommit, a committed transaction notifies no one by itself
// (Enqueue, EnqueueBatch and Deferred.Write alike): the NOTIFY comes from
// Wake, after the commit.
func TestWakeAfterCommitSendsNothingInTheTransaction(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 6)
	heard := e.listen(t)
	ctx := outbox.WakeAfterCommit(context.Background())
	msg := outbox.Message{Exchange: e.exchange, RoutingKey: boundKey}
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		if err := e.ob.Enqueue(ctx, tx, msg); err != nil {
			return err
		}
		if err := e.ob.EnqueueBatch(ctx, tx, []outbox.Message{msg, msg}); err != nil {
			return err
		}
		d := outbox.NewDeferred(tx)
		if err := e.ob.Enqueue(outbox.WithDeferred(ctx, d), tx, msg); err != nil {
			return err
		}
		return d.Write(ctx, tx)
	})
	if err != nil {
		t.Fatal(err)
	}
	e.sentinel(t, "committed")
	if p := next(t, heard); p != "committed" {
		t.Fatalf("notification %q before the sentinel: the transaction notified", p)
	}
	outbox.Wake(ctx)
	if p := next(t, heard); p != "" {
		t.Fatalf("notification %q, want Wake's", p)
	}
	outbox.Wake(ctx) // nothing written since the last Wake: nothing to wake
	e.sentinel(t, "end")
	if p := next(t, heard); p != "end" {
		t.Fatalf("notification %q: a Wake with nothing written notified", p)
	}
	if b := e.backlog(t); b.Pending != 4 {
		t.Fatalf("%d pending rows, want 4", b.Pending)
	}
}
