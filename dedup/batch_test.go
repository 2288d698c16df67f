package dedup_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/keystore"
	"github.com/idemq/idemq/internal/testdb"
)

func TestReserveBatchClassifiesEachRow(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 8, nil)
	ctx := context.Background()
	// Prepare: a completed key, a busy key, an expired lease, a released key.
	done := mustReserve(t, store, claim("done", "b"), dedup.Acquired).Lease
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return store.Complete(ctx, tx, done, dedup.Result{Outcome: dedup.OutcomeOK, Response: []byte("r")})
	}); err != nil {
		t.Fatal(err)
	}
	mustReserve(t, store, claim("busy", "b"), dedup.Acquired)
	expiring := claim("expired", "b")
	expiring.Lease = 100 * time.Millisecond
	mustReserve(t, store, expiring, dedup.Acquired)
	rel := mustReserve(t, store, claim("released", "b"), dedup.Acquired).Lease
	if err := store.Release(ctx, rel, "retried"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "lease to expire", func() bool {
		rec, err := store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: "expired"})
		return err == nil && !rec.LeaseValid
	})

	claims := []dedup.Claim{claim("new", "b"), claim("done", "b"), claim("busy", "b"), claim("expired", "b"), claim("released", "b"), claim("done2", "b")}
	reuse := claim("done", "other body")
	reuse.Tenant = "" // same scope as "done" would repeat it; use a fresh store call below
	got, err := keystore.Of(store).ReserveBatch(ctx, claims)
	if err != nil {
		t.Fatal(err)
	}
	want := []dedup.Decision{dedup.Acquired, dedup.Duplicate, dedup.Busy, dedup.Acquired, dedup.Acquired, dedup.Acquired}
	for i, r := range got {
		if r.Decision != want[i] {
			t.Fatalf("claim %d (%s): %s, want %s", i, claims[i].Key, r.Decision, want[i])
		}
	}
	if string(got[1].Record.Result.Response) != "r" {
		t.Fatalf("duplicate lacks the stored response: %+v", got[1].Record)
	}
	if got[3].Lease.Attempts != 2 || !got[3].Lease.TakenOver || got[4].Lease.Attempts != 2 {
		t.Fatalf("takeovers: %+v %+v", got[3].Lease, got[4].Lease)
	}
	r2, err := keystore.Of(store).ReserveBatch(ctx, []dedup.Claim{reuse})
	if err != nil || r2[0].Decision != dedup.KeyReuse {
		t.Fatalf("key reuse in batch: %+v %v", r2, err)
	}
	if _, err := keystore.Of(store).ReserveBatch(ctx, []dedup.Claim{claim("x", "b"), claim("x", "b")}); err == nil {
		t.Fatal("a batch repeating a key must be refused")
	}

	// Complete the acquired ones in one statement; a lost lease is reported.
	leases := []*dedup.Lease{got[0].Lease, got[3].Lease, got[4].Lease}
	stale := *got[5].Lease
	stale.Token = [16]byte{1}
	leases = append(leases, &stale)
	results := make([]dedup.Result, len(leases))
	for i := range results {
		results[i] = dedup.Result{Outcome: dedup.OutcomeOK, Code: 200 + i}
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	lost, err := keystore.Of(store).CompleteBatch(ctx, tx, leases, results)
	if err != nil || len(lost) != 1 || lost[0] != &stale {
		t.Fatalf("complete batch: lost %v, %v", lost, err)
	}
	_ = tx.Rollback(ctx)
	tx, _ = pool.Begin(ctx)
	if lost, err := keystore.Of(store).CompleteBatch(ctx, tx, leases[:3], results[:3]); err != nil || len(lost) != 0 {
		t.Fatalf("complete batch: lost %v, %v", lost, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	again, err := keystore.Of(store).ReserveBatch(ctx, claims[:1])
	if err != nil || again[0].Decision != dedup.Duplicate || again[0].Record.Result.Code != 200 {
		t.Fatalf("after batch complete: %+v %v", again, err)
	}
}

func TestReserveBatchConcurrentOneAcquiresEachKey(t *testing.T) {
	t.Parallel()
	const workers, keys, rounds = 8, 50, 10
	store, _ := newStore(t, workers+2, nil)
	ctx := context.Background()
	for r := range rounds {
		prefix := testdb.RandomHex(4)
		var mu sync.Mutex
		acquired := map[string]int{}
		var wg sync.WaitGroup
		start := make(chan struct{})
		for w := range workers {
			wg.Go(func() {
				<-start
				claims := make([]dedup.Claim, keys)
				for i := range keys {
					// Each worker claims the same keys in another order.
					claims[i] = claim(fmt.Sprintf("%s-%d", prefix, (i*7+w*13)%keys), "b")
				}
				res, err := keystore.Of(store).ReserveBatch(ctx, claims)
				if err != nil {
					t.Errorf("round %d: %v", r, err)
					return
				}
				mu.Lock()
				defer mu.Unlock()
				for i, x := range res {
					if x.Decision == dedup.Acquired {
						acquired[claims[i].Key]++
					} else if x.Decision != dedup.Busy {
						t.Errorf("decision %s", x.Decision)
					}
				}
			})
		}
		close(start)
		wg.Wait()
		if len(acquired) != keys {
			t.Fatalf("round %d: %d keys acquired, want %d", r, len(acquired), keys)
		}
		for k, n := range acquired {
			if n != 1 {
				t.Fatalf("round %d: key %s acquired %d times", r, k, n)
			}
		}
	}
}
