package dedup_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/dedup"
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
			_, err := store.ReserveTx(ctx, tx, claim("one", "body"))
			return err
		}},
		{"ReserveBatchTx", func(tx pgx.Tx) error {
			_, err := store.ReserveBatchTx(ctx, tx, []dedup.Claim{claim("two", "body"), claim("three", "body")})
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
