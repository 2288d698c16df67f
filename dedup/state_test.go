package dedup_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/keystore"
)

// A released key reads as released, with the reason its holder gave, until
// the next delivery takes it over exactly as before; a lease that merely
// expired (its holder died) is not released.
func TestReleasedKeyShowsItsReason(t *testing.T) {
	t.Parallel()
	store, _ := newStore(t, 4, nil)
	ctx := context.Background()

	l := mustReserve(t, store, claim("rel-1", "b"), dedup.Acquired).Lease
	if rec, err := store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: "rel-1"}); err != nil || rec.Released || rec.ReleaseReason != "" {
		t.Fatalf("held key: %+v, %v; want not released", rec, err)
	}
	if err := store.Release(ctx, l, "permanent_error"); err != nil {
		t.Fatal(err)
	}
	rec, err := store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: "rel-1"})
	if err != nil {
		t.Fatal(err)
	}
	if !rec.Released || rec.ReleaseReason != "permanent_error" || rec.LeaseValid || rec.State != dedup.StateInProgress {
		t.Fatalf("released key: released %v, reason %q, lease valid %v, state %s; want released by permanent_error",
			rec.Released, rec.ReleaseReason, rec.LeaseValid, rec.State)
	}

	// The protocol is unchanged: the next delivery takes it over.
	next := mustReserve(t, store, claim("rel-1", "b"), dedup.Acquired).Lease
	if !next.TakenOver || next.Attempts != 2 {
		t.Fatalf("after release: taken over %v, attempts %d; want true, 2", next.TakenOver, next.Attempts)
	}
	rec, err = store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: "rel-1"})
	if err != nil {
		t.Fatal(err)
	}
	if rec.Released || rec.ReleaseReason != "" || !rec.LeaseValid {
		t.Fatalf("taken over key: released %v, reason %q, lease valid %v; want held again", rec.Released, rec.ReleaseReason, rec.LeaseValid)
	}
	if err := store.Release(ctx, next, "max_attempts_exceeded"); err != nil {
		t.Fatal(err)
	}
	if rec, err = store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: "rel-1"}); err != nil || rec.ReleaseReason != "max_attempts_exceeded" {
		t.Fatalf("second release: %+v, %v; want reason max_attempts_exceeded", rec, err)
	}
	// A completion after a takeover clears the release.
	last := mustReserve(t, store, claim("rel-1", "b"), dedup.Acquired).Lease
	if err := pgx.BeginFunc(ctx, store.Pool(), func(tx pgx.Tx) error {
		return store.Complete(ctx, tx, last, dedup.Result{Outcome: dedup.OutcomeOK})
	}); err != nil {
		t.Fatal(err)
	}
	if rec, err = store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: "rel-1"}); err != nil || rec.Released || rec.ReleaseReason != "" || rec.State != dedup.StateCompleted {
		t.Fatalf("completed key: %+v, %v; want completed, not released", rec, err)
	}

	// An expired lease (a worker that died) is not a release.
	c := claim("rel-2", "b")
	c.Lease = 50 * time.Millisecond
	mustReserve(t, store, c, dedup.Acquired)
	waitFor(t, 5*time.Second, "lease to expire", func() bool {
		rec, err := store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: "rel-2"})
		return err == nil && !rec.LeaseValid
	})
	if rec, err = store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: "rel-2"}); err != nil || rec.Released {
		t.Fatalf("expired lease: %+v, %v; want not released", rec, err)
	}
}

// ReleaseBatch records each key's own reason.
func TestReleaseBatchRecordsReasons(t *testing.T) {
	t.Parallel()
	store, _ := newStore(t, 4, nil)
	ctx := context.Background()
	a := mustReserve(t, store, claim("relb-a", "b"), dedup.Acquired).Lease
	b := mustReserve(t, store, claim("relb-b", "b"), dedup.Acquired).Lease
	if _, err := keystore.Of(store).ReleaseBatch(ctx, []*dedup.Lease{a, b}, []string{"retried", "permanent_error"}); err != nil {
		t.Fatal(err)
	}
	for key, want := range map[string]string{"relb-a": "retried", "relb-b": "permanent_error"} {
		rec, err := store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: key})
		if err != nil {
			t.Fatal(err)
		}
		if !rec.Released || rec.ReleaseReason != want {
			t.Fatalf("%s: released %v, reason %q; want released by %s", key, rec.Released, rec.ReleaseReason, want)
		}
	}
	if _, err := keystore.Of(store).ReleaseBatch(ctx, []*dedup.Lease{a}, nil); err == nil {
		t.Fatal("ReleaseBatch with fewer reasons than leases: no error")
	}
}

// A rejection's reason is kept with its code and body, whichever way the
// key is completed, and a duplicate receives it.
func TestRejectionReasonIsStored(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 4, nil)
	ctx := context.Background()
	want := dedup.Result{Outcome: dedup.OutcomeRejected, Code: 402, Reason: "insufficient funds", Response: []byte(`{"balance":3}`)}
	check := func(key string) {
		t.Helper()
		rec, err := store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: key})
		if err != nil {
			t.Fatal(err)
		}
		if rec.Result == nil || rec.Result.Reason != want.Reason || rec.Result.Code != 402 || string(rec.Result.Response) != string(want.Response) {
			t.Fatalf("%s: stored result %+v, want %+v", key, rec.Result, want)
		}
		dup := mustReserve(t, store, claim(key, "b"), dedup.Duplicate)
		if dup.Record.Result.Reason != want.Reason {
			t.Fatalf("%s: duplicate's result reason %q, want %q", key, dup.Record.Result.Reason, want.Reason)
		}
	}

	one := mustReserve(t, store, claim("rej-one", "b"), dedup.Acquired).Lease
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return store.Complete(ctx, tx, one, want) }); err != nil {
		t.Fatal(err)
	}
	check("rej-one")

	queued := mustReserve(t, store, claim("rej-queued", "b"), dedup.Acquired).Lease
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		b := &pgx.Batch{}
		if err := keystore.Of(store).QueueComplete(b, queued, want); err != nil {
			return err
		}
		return tx.SendBatch(ctx, b).Close()
	}); err != nil {
		t.Fatal(err)
	}
	check("rej-queued")

	batch := mustReserve(t, store, claim("rej-batch", "b"), dedup.Acquired).Lease
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		lost, err := keystore.Of(store).CompleteBatch(ctx, tx, []*dedup.Lease{batch}, []dedup.Result{want})
		if err == nil && len(lost) > 0 {
			t.Errorf("lost %d leases", len(lost))
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	check("rej-batch")
}
