package dedup_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/keystore"
)

// A result's headers are stored with its code and body and come back to
// duplicates, from Complete, QueueComplete and CompleteBatch alike, for a
// lease of Reserve or one held by the transaction (ReserveTx); a result
// without headers reads back as none.
func TestResultHeadersAreStoredAndReplayed(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 4, nil)
	ctx := context.Background()
	headers := map[string][]string{"Content-Type": {"application/json"}, "Location": {"/payments/1"}, "Set-Cookie": {"a=1", "b=2"}}

	complete := map[string]func(tx pgx.Tx, l *dedup.Lease, r dedup.Result) error{
		"Complete": func(tx pgx.Tx, l *dedup.Lease, r dedup.Result) error { return store.Complete(ctx, tx, l, r) },
		"QueueComplete": func(tx pgx.Tx, l *dedup.Lease, r dedup.Result) error {
			b := &pgx.Batch{}
			if err := keystore.Of(store).QueueComplete(b, l, r); err != nil {
				return err
			}
			return tx.SendBatch(ctx, b).Close()
		},
		"CompleteBatch": func(tx pgx.Tx, l *dedup.Lease, r dedup.Result) error {
			lost, err := keystore.Of(store).CompleteBatch(ctx, tx, []*dedup.Lease{l}, []dedup.Result{r})
			if err == nil && len(lost) > 0 {
				t.Fatalf("lost %d leases", len(lost))
			}
			return err
		},
	}
	for name, fn := range complete {
		for _, want := range []map[string][]string{headers, nil} {
			for _, inTx := range []bool{false, true} {
				c := claim(fmt.Sprintf("headers-%s-%v-%v", name, want == nil, inTx), "{}")
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					var r dedup.Reservation
					var err error
					if inTx { // a lease held by the transaction (ReserveTx)
						r, err = keystore.Of(store).ReserveTx(ctx, tx, c)
					} else {
						r, err = store.Reserve(ctx, c)
					}
					if err != nil || r.Decision != dedup.Acquired {
						t.Fatalf("reserve: %v, %v", r.Decision, err)
					}
					return fn(tx, r.Lease, dedup.Result{Outcome: dedup.OutcomeOK, Code: 201, Headers: want, Response: []byte(`{"id":1}`)})
				})
				if err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				dup := mustReserve(t, store, c, dedup.Duplicate)
				if got := dup.Record.Result.Headers; !reflect.DeepEqual(got, want) {
					t.Errorf("%s (in tx %v): headers = %v, want %v", name, inTx, got, want)
				}
			}
		}
	}
}

// Forget deletes the row of a held lease: the key is absent again, also for
// another fingerprint; a lease already lost cannot forget.
func TestForgetMakesTheKeyAbsent(t *testing.T) {
	t.Parallel()
	for _, durable := range []bool{false, true} {
		store, _ := newStore(t, 4, &dedup.Config{DurableReservations: durable})
		ctx := context.Background()
		r := mustReserve(t, store, claim("forget-1", `{"amount":0}`), dedup.Acquired)
		if err := store.Forget(ctx, r.Lease); err != nil {
			t.Fatalf("forget: %v", err)
		}
		if _, err := store.Inspect(ctx, r.Lease.Scope); !errors.Is(err, dedup.ErrNotFound) {
			t.Fatalf("inspect after forget: %v, want ErrNotFound", err)
		}
		if err := store.Forget(ctx, r.Lease); !errors.Is(err, dedup.ErrLeaseLost) {
			t.Fatalf("second forget: %v, want ErrLeaseLost", err)
		}
		again := mustReserve(t, store, claim("forget-1", `{"amount":100}`), dedup.Acquired)
		if again.Lease.Attempts != 1 || again.Lease.TakenOver {
			t.Fatalf("reservation after forget: attempts %d, taken over %v: want a fresh row", again.Lease.Attempts, again.Lease.TakenOver)
		}
	}
}
