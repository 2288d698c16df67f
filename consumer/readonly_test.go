package consumer_test

import (
	"context"
	"errors"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/testdb"
)

// readOnly reports whether err is Postgres refusing a write in a read-only
// transaction (SQLSTATE 25006), what a standby answers.
func readOnly(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "25006"
}

// TestReadOnlyServerIsAnInfrastructureFailure: a store whose connections
// land on a read-only server (as on a standby: default_transaction_read_only
// makes every write fail with SQLSTATE 25006) sends each delivery to a retry
// tier with that cause and leaves no key behind, neither completed nor in
// progress. Once the store points at a writable server again, every message
// is processed, each effect exactly once, none dead-lettered.
func TestReadOnlyServerIsAnInfrastructureFailure(t *testing.T) {
	t.Parallel()
	h := newHarness(t, modeSingle, func(c *consumer.Config) {
		// Room for the retries while the server is read-only.
		c.MaxAttempts = 10
		c.RetryMax = time.Second
	})
	// The standby is played by a session setting given at connect, which
	// a pooler does not pass on: straight to Postgres.
	pcfg, err := pgxpool.ParseConfig(testdb.DirectURL())
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = 8
	pcfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	roPool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(roPool.Close)
	roStore, err := dedup.NewStore(roPool, &dedup.Config{Schema: h.schema})
	if err != nil {
		t.Fatal(err)
	}

	const n = 10
	for i := range n {
		h.publish(keyOf(i, "ro"), `{"n":1}`, nil)
	}
	ro, err := consumer.New(roStore, h.ledgerEffect, &h.cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ro.Run(ctx) }()
	evs := h.waitEvents(30*time.Second, "every message retried", func(evs []consumer.Event) bool {
		return countOutcomes(evs)[consumer.OutcomeRetried] >= n
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("run on the read-only server: %v", err)
	}
	for _, ev := range evs {
		if ev.Outcome != consumer.OutcomeRetried {
			t.Errorf("outcome %s on a read-only server, want retried only", ev.Outcome)
			continue
		}
		if !readOnly(ev.Err) {
			t.Errorf("retried with %v; want SQLSTATE 25006 (read_only_sql_transaction)", ev.Err)
		}
	}
	var keys int
	if err := h.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+pgx.Identifier{h.schema}.Sanitize()+".keys").Scan(&keys); err != nil {
		t.Fatal(err)
	}
	if keys != 0 {
		t.Fatalf("%d keys stored while the server was read-only, want none", keys)
	}

	// The store points at a writable server again: the retries go through.
	h.start(1, h.ledgerEffect)
	h.waitEvents(60*time.Second, "every message processed", func(evs []consumer.Event) bool {
		return countOutcomes(evs)[consumer.OutcomeProcessed] == n
	})
	effects := h.effects()
	for i := range n {
		if c := effects[keyOf(i, "ro")]; c != 1 {
			t.Errorf("key %d: %d effects, want 1", i, c)
		}
	}
	if dl := h.drainDLQ(); len(dl) != 0 {
		t.Errorf("%d dead letters, want none", len(dl))
	}
	if err := h.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+pgx.Identifier{h.schema}.Sanitize()+".keys WHERE state = 'completed'").Scan(&keys); err != nil {
		t.Fatal(err)
	}
	if keys != n {
		t.Errorf("%d keys completed, want %d", keys, n)
	}
}

// TestReadOnlyAtCompletionRollsBackTheEffect: when the key's completion
// meets a read-only transaction after the handler's writes (a server turned
// read-only under the handler), the effect rolls back with it, the key is
// released and the retry applies the effect once: no effect without its
// key, no completed key without its effect.
func TestReadOnlyAtCompletionRollsBackTheEffect(t *testing.T) {
	t.Parallel()
	h := newHarness(t, modeSingle, nil)
	h.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		resp, err := h.ledgerEffect(ctx, tx, d)
		if err == nil && d.Attempt == 1 {
			// From here on the transaction writes nothing: the completion
			// fails with SQLSTATE 25006.
			_, err = tx.Exec(ctx, "SET TRANSACTION READ ONLY")
		}
		return resp, err
	})
	const n = 10
	for i := range n {
		h.publish(keyOf(i, "ro-complete"), `{"n":1}`, nil)
	}
	evs := h.waitEvents(60*time.Second, "every message processed", func(evs []consumer.Event) bool {
		return countOutcomes(evs)[consumer.OutcomeProcessed] == n
	})
	retried := 0
	for _, ev := range evs {
		if ev.Outcome == consumer.OutcomeRetried {
			retried++
			if !readOnly(ev.Err) {
				t.Errorf("retried with %v; want SQLSTATE 25006", ev.Err)
			}
		}
	}
	if retried != n {
		t.Errorf("%d deliveries retried, want %d (each first attempt)", retried, n)
	}
	effects := h.effects()
	for i := range n {
		if c := effects[keyOf(i, "ro-complete")]; c != 1 {
			t.Errorf("key %d: %d effects, want 1", i, c)
		}
	}
}

// TestMultiHostPostgresURL: pgx's multi-host connection string with
// target_session_attrs=read-write, as docs/operations.md advises, skips a
// host that is down and never settles on a read-only server: a pool whose
// only server is read-only does not connect at all.
func TestMultiHostPostgresURL(t *testing.T) {
	t.Parallel()
	u, err := url.Parse(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("target_session_attrs", "read-write")
	u.RawQuery = q.Encode()
	single := *u
	u.Host = "127.0.0.1:1," + u.Host

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var mode string
	if err := pool.QueryRow(ctx, "SHOW transaction_read_only").Scan(&mode); err != nil || mode != "off" {
		t.Fatalf("multi-host pool: transaction_read_only %q, %v; want a writable server", mode, err)
	}

	// The same server, read-only for this session as a standby is.
	q.Set("options", "-c default_transaction_read_only=on")
	single.RawQuery = q.Encode()
	ro, err := pgxpool.New(ctx, single.String())
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	if err := ro.Ping(ctx); err == nil {
		t.Fatal("a read-write pool connected to a read-only server")
	}
}
