package dedup_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemq/idemq/dedup"
)

func TestStatsCountsEachScope(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 4, nil)
	ctx := context.Background()
	complete := func(key string, out dedup.Outcome) {
		t.Helper()
		r := mustReserve(t, store, claim(key, "{}"), dedup.Acquired)
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := store.Complete(ctx, tx, r.Lease, dedup.Result{Outcome: out, Reason: "no"}); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	complete("a", dedup.OutcomeOK)
	complete("b", dedup.OutcomeOK)
	complete("c", dedup.OutcomeRejected)
	mustReserve(t, store, claim("held", "{}"), dedup.Acquired)
	expired := claim("expired", "{}")
	expired.Lease = time.Millisecond
	mustReserve(t, store, expired, dedup.Acquired)
	released := mustReserve(t, store, claim("released", "{}"), dedup.Acquired)
	if err := store.Release(ctx, released.Lease, "retried"); err != nil {
		t.Fatal(err)
	}
	other := claim("x", "{}")
	other.Consumer = "ledger"
	mustReserve(t, store, other, dedup.Acquired)
	// A key completed two days ago counts in neither window.
	complete("old", dedup.OutcomeOK)
	if _, err := pool.Exec(ctx, `UPDATE `+store.Config().Schema+`.keys SET completed_at = now() - interval '2 days' WHERE key = 'old'`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the short lease to expire", func() bool {
		rec, err := store.Inspect(ctx, expired.Scope)
		return err == nil && !rec.LeaseValid
	})

	stats, err := store.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(stats) != 2 || stats[0].Consumer != "ledger" || stats[1].Consumer != "payments" {
		t.Fatalf("stats: %+v", stats)
	}
	p := stats[1]
	want := dedup.ScopeStats{
		Consumer: "payments", CompletedHour: 2, CompletedDay: 2, RejectedHour: 1, RejectedDay: 1,
		InProgress: 1, Expired: 1, Released: 1, Keys: 7,
	}
	if p.OldestLease <= 0 || p.OldestLease > time.Minute {
		t.Errorf("oldest lease age %s", p.OldestLease)
	}
	p.OldestLease = 0
	if p != want {
		t.Errorf("payments:\n got %+v\nwant %+v", p, want)
	}
	if stats[0].InProgress != 1 || stats[0].Keys != 1 {
		t.Errorf("ledger: %+v", stats[0])
	}
}
