//go:build cluster

package chaos

import (
	"context"
	"errors"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/deduptest"
)

// TestFailoverLosesOnlyAsynchronousReservations shows, on the Postgres
// primary and synchronous standby of make cluster, what a failover can and
// cannot lose. A key completed in its handler's transaction (synchronous
// commit) is on the standby before COMMIT returns; a store that reaches
// the standby alone cannot reserve (read_only_sql_transaction). A reservation
// (synchronous_commit = off) is not waited for: with the primary's WAL
// sender frozen (SIGSTOP), one is made, the primary stopped -m immediate and
// the standby promoted, and the reservation is gone. Its holder's
// completion is fenced by the lease token: it fails with ErrLeaseLost and
// its effect rolls back; the redelivery reserves the key anew and applies
// the effect once.
func TestFailoverLosesOnlyAsynchronousReservations(t *testing.T) {
	c := setUpCluster(t, false)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	cfg, err := pgxpool.ParseConfig(c.pgURL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	cfg.ConnConfig.ConnectTimeout = 5 * time.Second
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	schema := deduptest.Schema(t, pool)
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: schema, Lease: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	effects := pgx.Identifier{schema, "effects"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+effects+" (key text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	claim := func(key string) dedup.Claim {
		fp, _ := dedup.BodyFingerprint([]byte(key))
		return dedup.Claim{Scope: dedup.Scope{Consumer: "failover", Key: key}, Fingerprint: fp}
	}
	// handle applies key's effect and completes its lease in one
	// transaction, as the consumer does.
	handle := func(l *dedup.Lease) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "INSERT INTO "+effects+" (key) VALUES ($1)", l.Key); err != nil {
				return err
			}
			return store.Complete(ctx, tx, l, dedup.Result{Outcome: dedup.OutcomeOK, Code: 200})
		})
	}
	reserve := func(key string) *dedup.Lease {
		t.Helper()
		res, err := store.Reserve(ctx, claim(key))
		if err != nil || res.Decision != dedup.Acquired {
			t.Fatalf("reserve %s: %v, %v", key, res.Decision, err)
		}
		return res.Lease
	}

	// Completed before the failover: synchronous, on the standby.
	if err := handle(reserve("completed-before")); err != nil {
		t.Fatalf("complete: %v", err)
	}

	primary, standby := c.pg[c.primary], c.pg[1-c.primary]

	// A store that reaches the standby alone (no target_session_attrs)
	// cannot reserve: an error, read_only_sql_transaction, which the
	// runtime treats as an infrastructure failure; no decision, no row.
	roPool, err := pgxpool.New(ctx, standby.url)
	if err != nil {
		t.Fatal(err)
	}
	defer roPool.Close()
	roStore, err := dedup.NewStore(roPool, &dedup.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	var pgErr *pgconn.PgError
	if res, err := roStore.Reserve(ctx, claim("on-the-standby")); !errors.As(err, &pgErr) || pgErr.Code != "25006" {
		t.Fatalf("reserve on the standby: %v, %v; want read_only_sql_transaction (25006)", res.Decision, err)
	}
	var sender int
	if err := primary.query(ctx, "SELECT pid FROM pg_stat_replication WHERE sync_state = 'sync'", &sender); err != nil {
		t.Fatalf("find the WAL sender of the synchronous standby: %v", err)
	}
	if err := syscall.Kill(sender, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	// The immediate stop ends the frozen sender (SIGKILL after 5 s); this
	// is for a test that fails before it.
	defer func() { _ = syscall.Kill(sender, syscall.SIGCONT) }()

	lost := reserve("reserved-before")
	var onStandby int
	if err := standby.query(ctx, "SELECT count(*) FROM "+pgx.Identifier{schema, "keys"}.Sanitize(), &onStandby); err != nil {
		t.Fatal(err)
	}
	if onStandby != 1 {
		t.Fatalf("the standby has %d keys before the failover, want 1 (the completed one only)", onStandby)
	}

	detail, err := c.failover(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Log(detail)

	// The pool's connections went with the old primary; new ones find the
	// promoted standby.
	if err := waitUntil(ctx, time.Minute, func() bool { return pool.Ping(ctx) == nil }); err != nil {
		t.Fatalf("the pool does not reach the new primary: %v", err)
	}
	if rec, err := store.Inspect(ctx, claim("completed-before").Scope); err != nil || rec.State != dedup.StateCompleted {
		t.Fatalf("completed key after the failover: %+v, %v; want it completed", rec, err)
	}
	if _, err := store.Inspect(ctx, lost.Scope); !errors.Is(err, dedup.ErrNotFound) {
		t.Fatalf("asynchronous reservation after the failover: %v; want it lost (ErrNotFound), or the test did not freeze the standby's stream", err)
	}

	// Its holder cannot complete: the token fences the completion, and the
	// effect written in the same transaction rolls back.
	if err := handle(lost); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("completion of the lost reservation: %v, want ErrLeaseLost", err)
	}
	// The redelivery reserves the key again and applies the effect.
	if err := handle(reserve("reserved-before")); err != nil {
		t.Fatalf("complete after the redelivery: %v", err)
	}
	if res, err := store.Reserve(ctx, claim("completed-before")); err != nil || res.Decision != dedup.Duplicate {
		t.Fatalf("the completed key after the failover: %v, %v; want a duplicate", res.Decision, err)
	}
	var n, distinct int
	if err := pool.QueryRow(ctx, "SELECT count(*), count(DISTINCT key) FROM "+effects).Scan(&n, &distinct); err != nil {
		t.Fatal(err)
	}
	if n != 2 || distinct != 2 {
		t.Fatalf("%d effects for %d keys, want one effect for each of the 2 keys", n, distinct)
	}
}
