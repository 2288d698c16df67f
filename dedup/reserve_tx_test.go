package dedup_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/keystore"
)

// A reservation in the caller's transaction must not change how that
// transaction commits: the caller's effects and the key's completion commit
// with it, and an acknowledgement follows that commit. The autocommit
// reservations skip the WAL flush wait (set_config(..., true) for their own
// statement); inside a caller's transaction the same setting would last
// until its COMMIT and make the effects asynchronous.
func TestReserveTxKeepsTheCallersCommitDurable(t *testing.T) {
	store, pool := newStore(t, 2, nil)
	ctx := context.Background()
	for _, tc := range []struct {
		name    string
		reserve func(tx pgx.Tx) error
	}{
		{"ReserveTx", func(tx pgx.Tx) error {
			_, err := keystore.Of(store).ReserveTx(ctx, tx, claim("one", "body"))
			return err
		}},
		{"ReserveBatchTx", func(tx pgx.Tx) error {
			_, err := keystore.Of(store).ReserveBatchTx(ctx, tx, []dedup.Claim{claim("two", "body"), claim("three", "body")})
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx)
			if err := tc.reserve(tx); err != nil {
				t.Fatalf("reserve: %v", err)
			}
			var setting string
			if err := tx.QueryRow(ctx, "SHOW synchronous_commit").Scan(&setting); err != nil {
				t.Fatal(err)
			}
			if setting != "on" {
				t.Fatalf("synchronous_commit in the caller's transaction after %s = %q, want on: its COMMIT would not wait for the WAL flush", tc.name, setting)
			}
		})
	}
}

// A held reservation writes the row once: completed with the default result
// when the operation succeeds with it, with the given result otherwise; a
// rollback leaves the key absent.
func TestHeldReservationsWriteTheRowOnce(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 4, nil)
	ctx := context.Background()
	inspect := func(key string) *dedup.Record {
		t.Helper()
		rec, err := store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: key})
		if err != nil {
			t.Fatalf("inspect %s: %v", key, err)
		}
		return rec
	}
	rejected := dedup.Result{Outcome: dedup.OutcomeRejected, Code: 402, Reason: "insufficient funds", Response: []byte(`{"declined":true}`)}

	// A released key (an earlier attempt's infrastructure failure) is taken over.
	rel := mustReserve(t, store, claim("released", "b"), dedup.Acquired).Lease
	if err := store.Release(ctx, rel, "retried"); err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		res, err := keystore.Of(store).ReserveBatchTx(ctx, tx, []dedup.Claim{claim("ok", "b"), claim("rejected", "b"), claim("released", "b")})
		if err != nil {
			return err
		}
		leases := make([]*dedup.Lease, len(res))
		for i, r := range res {
			if r.Decision != dedup.Acquired || !r.Lease.HeldByTransaction() {
				t.Fatalf("claim %d: %s, held %v", i, r.Decision, r.Lease != nil && r.Lease.HeldByTransaction())
			}
			leases[i] = r.Lease
		}
		if !leases[2].TakenOver || leases[2].Attempts != 2 {
			t.Fatalf("takeover in the transaction: %+v", leases[2])
		}
		if err := store.Extend(ctx, leases[0], 0); err == nil {
			t.Fatal("Extend of a held lease: no error")
		}
		if err := store.Release(ctx, leases[0], "retried"); err == nil {
			t.Fatal("Release of a held lease: no error")
		}
		if err := store.Step(ctx, leases[0], "charge", func(context.Context, pgx.Tx) error { return nil }); err == nil {
			t.Fatal("Step of a held lease: no error")
		}
		lost, err := keystore.Of(store).CompleteBatch(ctx, tx, leases, []dedup.Result{{Outcome: dedup.OutcomeOK}, rejected, {Outcome: dedup.OutcomeOK, Response: []byte("r")}})
		if err != nil || len(lost) > 0 {
			t.Fatalf("complete: lost %d, %v", len(lost), err)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	for key, want := range map[string]dedup.Result{"ok": {Outcome: dedup.OutcomeOK}, "rejected": rejected, "released": {Outcome: dedup.OutcomeOK, Response: []byte("r")}} {
		rec := inspect(key)
		if rec.State != dedup.StateCompleted || rec.Result.Outcome != want.Outcome || rec.Result.Code != want.Code ||
			string(rec.Result.Response) != string(want.Response) || rec.Result.Reason != want.Reason || rec.LockedUntil != nil || rec.CompletedAt == nil {
			t.Fatalf("%s: %+v, want completed with %+v", key, rec, want)
		}
	}
	if rec := inspect("released"); rec.Attempts != 2 || rec.Released {
		t.Fatalf("taken-over key: attempts %d released %v", rec.Attempts, rec.Released)
	}
	mustReserve(t, store, claim("ok", "b"), dedup.Duplicate)

	// One key alone, through Complete; and a rollback.
	for _, r := range []dedup.Result{{Outcome: dedup.OutcomeOK}, rejected} {
		key := "single-" + string(r.Outcome)
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			res, err := keystore.Of(store).ReserveTx(ctx, tx, claim(key, "b"))
			if err != nil || res.Decision != dedup.Acquired || !res.Lease.HeldByTransaction() {
				t.Fatalf("reserve %s: %+v %v", key, res, err)
			}
			return store.Complete(ctx, tx, res.Lease, r)
		}); err != nil {
			t.Fatal(err)
		}
		if rec := inspect(key); rec.State != dedup.StateCompleted || rec.Result.Outcome != r.Outcome || rec.Result.Code != r.Code || rec.Result.Reason != r.Reason {
			t.Fatalf("%s: %+v", key, rec)
		}
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := keystore.Of(store).ReserveTx(ctx, tx, claim("rolled-back", "b")); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	mustReserve(t, store, claim("rolled-back", "b"), dedup.Acquired)
}

// While a held reservation's transaction runs, another reservation of the
// key waits for it, and then finds it completed (a duplicate).
func TestHeldReservationMakesACopyWaitThenFindADuplicate(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 4, nil)
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	res, err := keystore.Of(store).ReserveTx(ctx, tx, claim("k", "b"))
	if err != nil || res.Decision != dedup.Acquired {
		t.Fatalf("reserve: %+v %v", res, err)
	}
	copyDecision := make(chan dedup.Decision, 1)
	go func() {
		r, err := store.Reserve(ctx, claim("k", "b"))
		if err != nil {
			t.Errorf("copy: %v", err)
		}
		copyDecision <- r.Decision
	}()
	select {
	case d := <-copyDecision:
		t.Fatalf("the copy decided %s before the holder's commit", d)
	case <-time.After(200 * time.Millisecond): // the copy is waiting on the row lock
	}
	if err := store.Complete(ctx, tx, res.Lease, dedup.Result{Outcome: dedup.OutcomeOK}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case d := <-copyDecision:
		if d != dedup.Duplicate {
			t.Fatalf("the copy after the commit: %s, want duplicate", d)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the copy did not decide after the commit")
	}
}

// A held key given up with ReleaseTx (its operation failed, the rest of the
// transaction goes on) commits as Release leaves a key: in progress, no
// lease, released with the reason, taken over by the next reservation. A
// key that was released before (a takeover) reads the same.
func TestReleaseTxGivesUpHeldKeys(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 4, nil)
	ctx := context.Background()
	before := mustReserve(t, store, claim("taken-over", "b"), dedup.Acquired).Lease
	if err := store.Release(ctx, before, "retried"); err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		res, err := keystore.Of(store).ReserveBatchTx(ctx, tx, []dedup.Claim{claim("fresh", "b"), claim("taken-over", "b"), claim("kept", "b")})
		if err != nil {
			return err
		}
		if _, err := keystore.Of(store).ReleaseBatch(ctx, []*dedup.Lease{res[0].Lease}, []string{"retried"}); err == nil {
			t.Fatal("ReleaseBatch of a held lease: no error")
		}
		if err := keystore.Of(store).ReleaseTx(ctx, tx, []*dedup.Lease{before}, []string{"retried"}); err == nil {
			t.Fatal("ReleaseTx of a lease that is not held: no error")
		}
		return keystore.Of(store).ReleaseTx(ctx, tx, []*dedup.Lease{res[0].Lease, res[1].Lease}, []string{"permanent_error", "retried"})
	}); err != nil {
		t.Fatal(err)
	}
	for key, reason := range map[string]string{"fresh": "permanent_error", "taken-over": "retried"} {
		rec, err := store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: key})
		if err != nil {
			t.Fatal(err)
		}
		if rec.State != dedup.StateInProgress || !rec.Released || rec.ReleaseReason != reason || rec.LeaseValid || rec.Result != nil || rec.CompletedAt != nil {
			t.Fatalf("%s: %+v, want released by %s", key, rec, reason)
		}
		if l := mustReserve(t, store, claim(key, "b"), dedup.Acquired).Lease; !l.TakenOver {
			t.Fatalf("%s: the next reservation did not take the released key over", key)
		}
	}
	mustReserve(t, store, claim("kept", "b"), dedup.Duplicate)
}

// A held key turned into a lease (LeaseTx) is, once the transaction
// commits, what a separate reservation leaves: in progress under the new
// lease, which extends and completes; the attempt is not counted again. If
// the transaction rolls back, the lease is void.
func TestLeaseTxTurnsAHeldKeyIntoALease(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 4, nil)
	ctx := context.Background()
	var leases []*dedup.Lease
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		res, err := keystore.Of(store).ReserveBatchTx(ctx, tx, []dedup.Claim{claim("leased", "b"), claim("kept", "b")})
		if err != nil {
			return err
		}
		leases, err = keystore.Of(store).LeaseTx(ctx, tx, []*dedup.Lease{res[0].Lease}, 30*time.Second)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	l := leases[0]
	if l.HeldByTransaction() || time.Until(l.LockedUntil) < 20*time.Second {
		t.Fatalf("lease %+v: want a separate lease for 30s", l)
	}
	rec, err := store.Inspect(ctx, l.Scope)
	if err != nil {
		t.Fatal(err)
	}
	if rec.State != dedup.StateInProgress || !rec.LeaseValid || rec.Attempts != 1 || rec.Result != nil {
		t.Fatalf("after the commit: %+v, want in progress under a valid lease, attempt 1", rec)
	}
	mustReserve(t, store, claim("leased", "b"), dedup.Busy)
	if err := store.Extend(ctx, l, 0); err != nil {
		t.Fatalf("extend: %v", err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return store.Complete(ctx, tx, l, dedup.Result{Outcome: dedup.OutcomeOK, Code: 201})
	}); err != nil {
		t.Fatalf("complete under the lease: %v", err)
	}
	mustReserve(t, store, claim("leased", "b"), dedup.Duplicate)
	mustReserve(t, store, claim("kept", "b"), dedup.Duplicate)

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	res, err := keystore.Of(store).ReserveTx(ctx, tx, claim("rolled-back", "b"))
	if err != nil {
		t.Fatal(err)
	}
	void, err := keystore.Of(store).LeaseTx(ctx, tx, []*dedup.Lease{res.Lease}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := store.Extend(ctx, void[0], 0); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("extend a lease whose transaction rolled back: %v, want ErrLeaseLost", err)
	}
	mustReserve(t, store, claim("rolled-back", "b"), dedup.Acquired)
}
