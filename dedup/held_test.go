package dedup_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/keystore"
)

// begin starts a transaction on a connection of its own, as a caller of
// CompleteCommit does, and gives both back to the pool at the end of the test.
func begin(t *testing.T, pool *pgxpool.Pool) (*pgxpool.Conn, pgx.Tx) {
	t.Helper()
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		conn.Release()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if conn.Conn().PgConn().TxStatus() != 'I' {
			_ = tx.Rollback(ctx)
		}
		conn.Release()
	})
	return conn, tx
}

// A key held by another transaction is refused at once, never waited for:
// busy while the holder runs, then the holder's answer once it committed,
// and that answer also while a third transaction holds the key's lock.
func TestTryReserveTxRefusesWhileAnotherHoldsTheKey(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 8, nil)
	keys := keystore.Of(store)
	ctx := context.Background()
	try := func(tx pgx.Tx, c dedup.Claim) dedup.Reservation {
		t.Helper()
		// A reservation that waited for the holder would wait for the
		// test's end: the deadline turns that into a failure.
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		res, err := keys.TryReserveTx(ctx, tx, c)
		if err != nil {
			t.Fatalf("try reserve: %v", err)
		}
		return res
	}

	_, holder := begin(t, pool)
	first := try(holder, claim("k", "body"))
	if first.Decision != dedup.Acquired || !first.Lease.HeldByTransaction() {
		t.Fatalf("first = %+v, want acquired, held by its transaction", first)
	}
	_, other := begin(t, pool)
	if res := try(other, claim("k", "body")); res.Decision != dedup.Busy {
		t.Fatalf("while held: %s, want busy", res.Decision)
	}
	if res := try(other, claim("k", "other body")); res.Decision != dedup.Busy {
		t.Fatalf("another operation while held (nothing committed yet): %s, want busy", res.Decision)
	}

	result := dedup.Result{Outcome: dedup.OutcomeOK, Code: 201, Response: []byte(`{"id":1}`)}
	if err := keys.CompleteCommit(ctx, holder, first.Lease, result); err != nil {
		t.Fatalf("complete and commit: %v", err)
	}
	_, late := begin(t, pool)
	dup := try(late, claim("k", "body"))
	if dup.Decision != dedup.Duplicate || dup.Record.Result == nil || dup.Record.Result.Code != 201 {
		t.Fatalf("after the commit: %+v, want the duplicate of 201", dup)
	}
	// late holds the key's lock now: a copy that does not get it answers
	// from the committed row, as late did.
	_, third := begin(t, pool)
	if res := try(third, claim("k", "body")); res.Decision != dedup.Duplicate {
		t.Fatalf("while another copy holds the lock: %s, want duplicate", res.Decision)
	}
	if res := try(third, claim("k", "other body")); res.Decision != dedup.KeyReuse {
		t.Fatalf("another operation while another copy holds the lock: %s, want key_reuse", res.Decision)
	}
}

// CompleteCommit commits the effects and the result in one round trip, and
// never the effects of a lease that was lost: the completion fails the
// transaction before the COMMIT behind it runs.
func TestCompleteCommit(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 8, nil)
	keys := keystore.Of(store)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+store.Config().Schema+".effects (key text PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	effect := func(tx pgx.Tx, key string) {
		t.Helper()
		if _, err := tx.Exec(ctx, "INSERT INTO "+store.Config().Schema+".effects VALUES ($1)", key); err != nil {
			t.Fatal(err)
		}
	}
	effects := func(key string) (n int) {
		t.Helper()
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+store.Config().Schema+".effects WHERE key = $1", key).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	result := dedup.Result{Outcome: dedup.OutcomeRejected, Code: 402, Reason: "declined", Response: []byte(`{"declined":true}`)}

	t.Run("held", func(t *testing.T) {
		conn, tx := begin(t, pool)
		res, err := keys.TryReserveTx(ctx, tx, claim("held", "b"))
		if err != nil || res.Decision != dedup.Acquired {
			t.Fatalf("reserve: %+v, %v", res, err)
		}
		effect(tx, "held")
		if err := keys.CompleteCommit(ctx, tx, res.Lease, result); err != nil {
			t.Fatalf("complete and commit: %v", err)
		}
		if s := conn.Conn().PgConn().TxStatus(); s != 'I' {
			t.Fatalf("transaction status after CompleteCommit = %c, want I (committed)", s)
		}
		rec, err := store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: "held"})
		if err != nil || rec.State != dedup.StateCompleted || rec.Result.Code != 402 || string(rec.Result.Response) != `{"declined":true}` {
			t.Fatalf("key = %+v, %v; want completed with 402", rec, err)
		}
		if n := effects("held"); n != 1 {
			t.Fatalf("effects = %d, want 1", n)
		}
	})

	t.Run("presumed result", func(t *testing.T) {
		_, tx := begin(t, pool)
		res, err := keys.TryReserveTx(ctx, tx, claim("presumed", "b"))
		if err != nil || res.Decision != dedup.Acquired {
			t.Fatalf("reserve: %+v, %v", res, err)
		}
		if err := keys.CompleteCommit(ctx, tx, res.Lease, dedup.Result{Outcome: dedup.OutcomeOK}); err != nil {
			t.Fatalf("complete and commit: %v", err)
		}
		if rec, err := store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: "presumed"}); err != nil || rec.State != dedup.StateCompleted {
			t.Fatalf("key = %+v, %v; want completed", rec, err)
		}
	})

	t.Run("written meanwhile", func(t *testing.T) {
		// TryReserveTx found the key absent and wrote nothing; a
		// reservation that takes no advisory lock (a separate one) writes
		// the key before the completion does.
		conn, tx := begin(t, pool)
		res, err := keys.TryReserveTx(ctx, tx, claim("raced", "b"))
		if err != nil || res.Decision != dedup.Acquired {
			t.Fatalf("reserve: %+v, %v", res, err)
		}
		effect(tx, "raced")
		other := mustReserve(t, store, claim("raced", "b"), dedup.Acquired)
		err = keys.CompleteCommit(ctx, tx, res.Lease, result)
		if !errors.Is(err, dedup.ErrLeaseLost) {
			t.Fatalf("complete and commit of a key written meanwhile: %v, want ErrLeaseLost", err)
		}
		if s := conn.Conn().PgConn().TxStatus(); s != 'E' {
			t.Fatalf("transaction status = %c, want E (failed, not committed)", s)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatalf("rollback: %v", err)
		}
		if n := effects("raced"); n != 0 {
			t.Fatalf("effects = %d, want 0 (rolled back)", n)
		}
		if err := store.Complete(ctx, mustBegin(t, pool), other.Lease, dedup.Result{Outcome: dedup.OutcomeOK}); err != nil {
			t.Fatalf("the other reservation's completion: %v", err)
		}
	})

	t.Run("lost lease", func(t *testing.T) {
		c := claim("lost", "b")
		c.Lease = 50 * time.Millisecond
		lost := mustReserve(t, store, c, dedup.Acquired).Lease
		conn, tx := begin(t, pool)
		effect(tx, "lost")
		// The lease expires and another worker takes the key over.
		var taken dedup.Reservation
		waitFor(t, 5*time.Second, "the lease to be taken over", func() bool {
			var err error
			taken, err = store.Reserve(ctx, c)
			if err != nil {
				t.Fatal(err)
			}
			return taken.Decision == dedup.Acquired
		})
		err := keys.CompleteCommit(ctx, tx, lost, result)
		if !errors.Is(err, dedup.ErrLeaseLost) {
			t.Fatalf("complete and commit of a lost lease: %v, want ErrLeaseLost", err)
		}
		if s := conn.Conn().PgConn().TxStatus(); s != 'E' {
			t.Fatalf("transaction status = %c, want E (failed, not committed)", s)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatalf("rollback: %v", err)
		}
		if n := effects("lost"); n != 0 {
			t.Fatalf("effects of the lost lease = %d, want 0 (rolled back)", n)
		}
		rec, err := store.Inspect(ctx, c.Scope)
		if err != nil || rec.State != dedup.StateInProgress || !rec.LeaseValid {
			t.Fatalf("key = %+v, %v; want the taker's lease", rec, err)
		}
	})
}

// mustBegin begins a transaction on the pool, rolled back at the test's end.
func mustBegin(t *testing.T, pool *pgxpool.Pool) pgx.Tx {
	t.Helper()
	tx, err := pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx
}
