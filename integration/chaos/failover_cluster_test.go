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

// TestFailoverLosesOnlyAsynchronousReservations shows, on the Patroni
// cluster of make cluster (synchronous mode), what a failover can and
// cannot lose. A key completed in its handler's transaction (synchronous
// commit) is on the synchronous standby before COMMIT returns; a store that
// reaches a replica alone cannot reserve (read_only_sql_transaction). A
// reservation (synchronous_commit = off) is not waited for: with the
// leader's WAL senders frozen (SIGSTOP), one is made, the leader's
// postmaster killed (SIGKILL, then the frozen senders) and Patroni left to
// promote the synchronous standby, and the reservation is gone. Its holder's
// completion is fenced by the lease token: it fails with ErrLeaseLost and
// its effect rolls back; the redelivery reserves the key anew and applies
// the effect once. The old leader comes back as a replica of the new one
// (Patroni rewinds it), without the reservation.
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

	st, err := c.pg.whole(ctx)
	if err != nil {
		t.Fatal(err)
	}
	leaderState, _ := st.role("leader")
	standbyState, _ := st.role("sync_standby")
	leader, standby := c.pg.member(leaderState.Name), c.pg.member(standbyState.Name)

	// A store that reaches a replica alone (no target_session_attrs)
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

	// Freeze every WAL sender, the synchronous standby's and the
	// asynchronous replica's: what is written now stays on the leader.
	var senders []int
	rows, err := pool.Query(ctx, "SELECT pid FROM pg_stat_replication")
	if err != nil {
		t.Fatal(err)
	}
	if senders, err = pgx.CollectRows(rows, pgx.RowTo[int]); err != nil || len(senders) != patroniMembers-1 {
		t.Fatalf("the leader's WAL senders: %v, %v; want %d", senders, err, patroniMembers-1)
	}
	for _, pid := range senders {
		if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
	}
	// The crash below kills the frozen senders; this is for a test that
	// fails before it.
	defer func() {
		for _, pid := range senders {
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}
	}()

	lost := reserve("reserved-before")
	for _, m := range c.pg.members {
		if m == leader {
			continue
		}
		var keys int
		if err := m.query(ctx, "SELECT count(*) FROM "+pgx.Identifier{schema, "keys"}.Sanitize(), &keys); err != nil {
			t.Fatal(err)
		}
		if keys != 1 {
			t.Fatalf("replica %s has %d keys before the failover, want 1 (the completed one only)", m, keys)
		}
	}

	// The crash: the postmaster first, so that nothing restarts the
	// senders, then the senders, which would otherwise send the rest when
	// thawed.
	killed, err := c.pg.killPostmaster(leader)
	if err != nil {
		t.Fatal(err)
	}
	for _, pid := range senders {
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
	}
	next, _, err := c.pg.awaitLeader(ctx, leader.name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("leader %s's postmaster killed; %s leads and takes writes %.1fs later", leader, next, time.Since(killed).Seconds())
	if next != standby {
		t.Fatalf("Patroni promoted %s, not the synchronous standby %s", next, standby)
	}

	// The pool's connections went with the old leader; new ones find the
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

	// Fenced: Patroni brings the old leader back as a replica of the new
	// one, rewound to the new leader's history, without the reservation.
	after, err := c.pg.awaitWhole(ctx, 3*time.Minute)
	if err != nil {
		t.Fatalf("the old leader %s does not come back as a replica: %v", leader, err)
	}
	var replica bool
	var keys int
	if err := leader.query(ctx, "SELECT pg_is_in_recovery()", &replica); err != nil || !replica {
		t.Fatalf("the old leader %s: in recovery %v, %v; want a replica", leader, replica, err)
	}
	// The lost reservation's row, in progress, is gone from it: both keys
	// are completed, as on the new leader.
	err = waitUntil(ctx, time.Minute, func() bool {
		return leader.query(ctx, "SELECT count(*) FROM "+pgx.Identifier{schema, "keys"}.Sanitize()+" WHERE state = 'completed'", &keys) == nil && keys == 2
	})
	if err != nil {
		t.Fatalf("the old leader %s has %d completed keys as a replica, want the new leader's 2: %v", leader, keys, err)
	}
	t.Logf("the old leader %s a replica again %.1fs after the kill (%s)", leader, time.Since(killed).Seconds(), after)
}
