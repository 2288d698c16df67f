package dedup_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/keystore"
	"github.com/idemq/idemq/internal/testdb"
)

// BenchmarkReserveComplete measures one key's full protocol: reserve, then
// complete in its own transaction (one commit per key).
func BenchmarkReserveComplete(b *testing.B) {
	for _, workers := range []int{1, 8} {
		b.Run(fmt.Sprintf("goroutines=%d", workers), func(b *testing.B) {
			store, pool := newStore(b, int32(workers+2), nil)
			ctx := context.Background()
			prefix := testdb.RandomHex(4)
			fp, _ := dedup.BodyFingerprint([]byte(`{"amount":100}`))
			var seq atomic.Int64
			b.ResetTimer()
			runParallel(b, workers, func() error {
				c := dedup.Claim{Scope: dedup.Scope{Consumer: "bench", Key: fmt.Sprintf("%s-%d", prefix, seq.Add(1))}, Fingerprint: fp}
				r, err := store.Reserve(ctx, c)
				if err != nil {
					return err
				}
				return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					return store.Complete(ctx, tx, r.Lease, dedup.Result{Outcome: dedup.OutcomeOK})
				})
			})
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "keys/s")
		})
	}
}

// runParallel runs b.N calls of fn over exactly workers goroutines.
func runParallel(b *testing.B, workers int, fn func() error) {
	var next atomic.Int64
	errs := make(chan error, workers)
	for range workers {
		go func() {
			for next.Add(1) <= int64(b.N) {
				if err := fn(); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for range workers {
		if err := <-errs; err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkJSONFieldsFingerprint(b *testing.B) {
	fp := dedup.JSONFieldsFingerprint("amount", "currency", "payer.account")
	body := []byte(`{"amount":100,"currency":"EUR","payer":{"account":"A","name":"n"},"note":"some words of comment"}`)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := fp(body); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkValidateKey(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		_ = dedup.ValidateKey("order-2026-11-30-000042-charge")
	}
}

// BenchmarkReserveCompleteBatch measures the batched protocol: 100 keys
// reserved by one statement and completed by one statement in one
// transaction, on a table that already holds 200,000 keys (so that a plan
// that scans the table would show).
func BenchmarkReserveCompleteBatch(b *testing.B) {
	const batch = 100
	store, pool := newStore(b, 4, nil)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `INSERT INTO `+store.Config().Schema+`.keys (consumer, tenant, key, state, fingerprint, outcome, completed_at)
		SELECT 'bench', '', 'old-' || g, 'completed', '\x00', 'ok', now() FROM generate_series(1, 200000) g`); err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "ANALYZE "+store.Config().Schema+".keys"); err != nil {
		b.Fatal(err)
	}
	prefix := testdb.RandomHex(4)
	fp, _ := dedup.BodyFingerprint([]byte(`{"amount":100}`))
	seq := 0
	b.ResetTimer()
	for b.Loop() {
		claims := make([]dedup.Claim, batch)
		for i := range claims {
			seq++
			claims[i] = dedup.Claim{Scope: dedup.Scope{Consumer: "bench", Key: fmt.Sprintf("%s-%d", prefix, seq)}, Fingerprint: fp}
		}
		res, err := keystore.Of(store).ReserveBatch(ctx, claims)
		if err != nil {
			b.Fatal(err)
		}
		leases := make([]*dedup.Lease, batch)
		results := make([]dedup.Result, batch)
		for i, r := range res {
			leases[i], results[i] = r.Lease, dedup.Result{Outcome: dedup.OutcomeOK}
		}
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			lost, err := keystore.Of(store).CompleteBatch(ctx, tx, leases, results)
			if err == nil && len(lost) > 0 {
				err = fmt.Errorf("%d leases lost", len(lost))
			}
			return err
		})
		if err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N*batch)/b.Elapsed().Seconds(), "keys/s")
}
