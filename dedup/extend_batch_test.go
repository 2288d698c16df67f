package dedup_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/keystore"
)

// A group's heartbeat runs beside the group's transaction, which locks each
// key as it completes it. The heartbeat must not wait for those locks: it
// would deadlock with the group (it holds the next key's lock while the
// group waits for it). It skips the locked key, extends the others and
// reports nothing lost.
func TestExtendBatchSkipsKeysLockedByTheGroup(t *testing.T) {
	t.Parallel()
	for _, durable := range []bool{false, true} {
		t.Run(map[bool]string{false: "async", true: "durable"}[durable], func(t *testing.T) {
			t.Parallel()
			testExtendBatchSkipsLocked(t, &dedup.Config{Lease: 5 * time.Second, DurableReservations: durable})
		})
	}
}

func testExtendBatchSkipsLocked(t *testing.T, cfg *dedup.Config) {
	store, pool := newStore(t, 6, cfg)
	ctx := context.Background()
	a := mustReserve(t, store, claim("group-a", "a"), dedup.Acquired).Lease
	b := mustReserve(t, store, claim("group-b", "b"), dedup.Acquired).Lease

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if err := store.Complete(ctx, tx, a, dedup.Result{Outcome: dedup.OutcomeOK}); err != nil {
		t.Fatal(err)
	}
	aUntil, bUntil := a.LockedUntil, b.LockedUntil

	beat, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	lost, err := keystore.Of(store).ExtendBatch(beat, []*dedup.Lease{b, a}, 10*time.Second)
	if err != nil {
		t.Fatalf("extend beside the group's transaction: %v (it waited for the group's lock)", err)
	}
	if len(lost) != 0 {
		t.Fatalf("%d leases reported lost; the locked one is busy, not lost", len(lost))
	}
	if !b.LockedUntil.After(bUntil) {
		t.Fatalf("the free lease was not extended: %s, was %s", b.LockedUntil, bUntil)
	}
	if !a.LockedUntil.Equal(aUntil) {
		t.Fatalf("the locked lease moved: %s, was %s", a.LockedUntil, aUntil)
	}

	// The group goes on and commits both.
	if err := store.Complete(ctx, tx, b, dedup.Result{Outcome: dedup.OutcomeOK}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// Completed keys are lost to a heartbeat: nothing to extend any more.
	lost, err = keystore.Of(store).ExtendBatch(ctx, []*dedup.Lease{a, b}, 0)
	if err != nil || len(lost) != 2 {
		t.Fatalf("extend completed keys: lost %d, err %v; want both lost", len(lost), err)
	}
}
