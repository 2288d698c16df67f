package dedup_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/dedup"
)

// testLease is short, so that the heartbeat beats many times in a test.
const testLease = 300 * time.Millisecond // the claims' and the heartbeats'; the store's is longer

// held reserves key and returns it with a context the heartbeat cancels.
func held(t *testing.T, store *dedup.Store, key string) (dedup.Held, context.Context) {
	t.Helper()
	c := claim(key, key)
	c.Lease = testLease
	l := mustReserve(t, store, c, dedup.Acquired).Lease
	ctx, cancel := context.WithCancelCause(context.Background())
	t.Cleanup(func() { cancel(nil) })
	return dedup.Held{Lease: l, Cancel: cancel}, ctx
}

// takeOver gives key's row another lease token, as a takeover by another
// worker does.
func takeOver(t *testing.T, store *dedup.Store, key string) {
	t.Helper()
	tag, err := store.Pool().Exec(context.Background(),
		`UPDATE `+pgx.Identifier{store.Config().Schema, "keys"}.Sanitize()+` SET lease_token = gen_random_uuid() WHERE key = $1`, key)
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("take %s over: %v (%d rows)", key, err, tag.RowsAffected())
	}
}

// The heartbeat keeps a lease valid for many times its duration: another
// reservation of the key finds it busy, and the holder's context goes on.
func TestHeartbeatKeepsTheLeaseAlive(t *testing.T) {
	t.Parallel()
	store, _ := newStore(t, 4, nil)
	h, ctx := held(t, store, "alive")
	stop := dedup.Heartbeat(context.Background(), store, []dedup.Held{h}, dedup.HeartbeatOptions{Lease: testLease})
	defer stop()

	select {
	case <-ctx.Done():
		t.Fatalf("the holder's context ended: %v", context.Cause(ctx))
	case <-time.After(4 * testLease):
	}
	mustReserve(t, store, claim("alive", "alive"), dedup.Busy)
	stop()
	stop() // twice is safe
}

// A lease taken over ends its holder's context, with a cause that wraps
// ErrLeaseLost, by the next beat (a third of the lease).
func TestHeartbeatCancelsALostLease(t *testing.T) {
	t.Parallel()
	store, _ := newStore(t, 4, nil)
	h, ctx := held(t, store, "lost")
	stop := dedup.Heartbeat(context.Background(), store, []dedup.Held{h}, dedup.HeartbeatOptions{Lease: testLease})
	defer stop()

	takeOver(t, store, "lost")
	took := time.Now()
	select {
	case <-ctx.Done():
	case <-time.After(testLease):
		t.Fatal("the holder's context went on after its lease was taken over")
	}
	if waited := time.Since(took); waited > testLease/3+testLease/6 {
		t.Errorf("cancelled %s after the takeover, want within about a third of the lease (%s)", waited, testLease/3)
	}
	if cause := context.Cause(ctx); !errors.Is(cause, dedup.ErrLeaseLost) {
		t.Fatalf("cause = %v, want ErrLeaseLost", cause)
	}
}

// A lease that expires without a heartbeat and is reserved again by another
// worker is lost too, the moment the heartbeat starts beating.
func TestHeartbeatCancelsAnExpiredLeaseTakenOver(t *testing.T) {
	t.Parallel()
	store, _ := newStore(t, 4, nil)
	c := claim("expired", "expired")
	c.Lease = time.Millisecond
	l := mustReserve(t, store, c, dedup.Acquired).Lease
	var taken dedup.Reservation
	waitFor(t, 5*time.Second, "the lease to expire and be taken over", func() bool {
		r, err := store.Reserve(context.Background(), claim("expired", "expired"))
		taken = r
		return err == nil && r.Decision == dedup.Acquired
	})
	if !taken.Lease.TakenOver {
		t.Fatal("the second reservation did not take the key over")
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	stop := dedup.Heartbeat(context.Background(), store, []dedup.Held{{Lease: l, Cancel: cancel}}, dedup.HeartbeatOptions{Lease: testLease})
	defer stop()
	select {
	case <-ctx.Done():
	case <-time.After(2 * testLease):
		t.Fatal("the holder's context went on after its lease was taken over")
	}
	if !errors.Is(context.Cause(ctx), dedup.ErrLeaseLost) {
		t.Fatalf("cause = %v, want ErrLeaseLost", context.Cause(ctx))
	}
}

// Of N leases kept by one heartbeat, the one lost ends its own holder's
// context only: the others are extended on, past their duration.
func TestHeartbeatCancelsOnlyTheLeaseLost(t *testing.T) {
	t.Parallel()
	store, _ := newStore(t, 4, nil)
	keys := []string{"n-0", "n-1", "n-2"}
	hs, ctxs := make([]dedup.Held, len(keys)), make([]context.Context, len(keys))
	for i, k := range keys {
		hs[i], ctxs[i] = held(t, store, k)
	}
	var errs []error
	stop := dedup.Heartbeat(context.Background(), store, hs, dedup.HeartbeatOptions{Lease: testLease, OnError: func(err error) { errs = append(errs, err) }})
	defer stop()

	takeOver(t, store, "n-1")
	select {
	case <-ctxs[1].Done():
	case <-time.After(testLease):
		t.Fatal("the lost lease's context went on")
	}
	if !errors.Is(context.Cause(ctxs[1]), dedup.ErrLeaseLost) {
		t.Fatalf("cause = %v, want ErrLeaseLost", context.Cause(ctxs[1]))
	}
	select {
	case <-ctxs[0].Done():
		t.Fatalf("a lease kept ended: %v", context.Cause(ctxs[0]))
	case <-ctxs[2].Done():
		t.Fatalf("a lease kept ended: %v", context.Cause(ctxs[2]))
	case <-time.After(3 * testLease):
	}
	for _, k := range []string{"n-0", "n-2"} {
		mustReserve(t, store, claim(k, k), dedup.Busy)
	}
	stop()
	if len(errs) != 0 {
		t.Fatalf("beats failed: %v", errs)
	}
}

// Stopping the heartbeat before the holder's work ends leaves the context
// alone, and the lease then runs out by itself.
func TestHeartbeatStopLeavesTheContext(t *testing.T) {
	t.Parallel()
	store, _ := newStore(t, 4, nil)
	h, ctx := held(t, store, "stopped")
	stop := dedup.Heartbeat(context.Background(), store, []dedup.Held{h}, dedup.HeartbeatOptions{Lease: testLease})
	stop()
	if ctx.Err() != nil {
		t.Fatalf("stop cancelled the holder: %v", context.Cause(ctx))
	}
	waitFor(t, 5*time.Second, "the lease to run out", func() bool {
		r, err := store.Reserve(context.Background(), claim("stopped", "stopped"))
		return err == nil && r.Decision == dedup.Acquired
	})
}
