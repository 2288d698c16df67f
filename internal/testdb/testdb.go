// Package testdb gives integration tests a real Postgres, isolated per test.
//
// The database comes from IDEMQ_TEST_POSTGRES_URL (default: the local
// trust-auth server). A test that cannot reach it fails with a clear
// message; it never skips.
package testdb

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultURL is the database used when IDEMQ_TEST_POSTGRES_URL is unset.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// URL returns the test database URL.
func URL() string {
	if u := os.Getenv("IDEMQ_TEST_POSTGRES_URL"); u != "" {
		return u
	}
	return DefaultURL
}

// DirectURL is the test database reached without a pooler, for what needs
// a session of its own (LISTEN, GC's VACUUM, startup parameters):
// IDEMQ_TEST_POSTGRES_DIRECT_URL, else URL. make test sets it when it runs
// the suites through PgBouncer (IDEMQ_TEST_POSTGRES_URL then names it).
func DirectURL() string {
	if u := os.Getenv("IDEMQ_TEST_POSTGRES_DIRECT_URL"); u != "" {
		return u
	}
	return URL()
}

// Direct is DirectURL's connection config.
func Direct(tb testing.TB) *pgx.ConnConfig {
	tb.Helper()
	cfg, err := pgx.ParseConfig(DirectURL())
	if err != nil {
		tb.Fatalf("testdb: parse IDEMQ_TEST_POSTGRES_DIRECT_URL: %v", err)
	}
	return cfg
}

// Pooled reports whether the tests reach Postgres through a pooler: the
// test database's URL is not its direct one.
func Pooled() bool { return DirectURL() != URL() }

// PgBouncerURL is the test database through PgBouncer in transaction
// pooling mode, which make test starts (deploy/local/ensure-pgbouncer.sh):
// IDEMQ_TEST_PGBOUNCER_URL. A test that needs it fails without it.
func PgBouncerURL(tb testing.TB) string {
	tb.Helper()
	u := os.Getenv("IDEMQ_TEST_PGBOUNCER_URL")
	if u == "" {
		tb.Fatal("testdb: IDEMQ_TEST_PGBOUNCER_URL is not set: run make test, or start PgBouncer with deploy/local/ensure-pgbouncer.sh and set it as that script prints")
	}
	return u
}

// Pool opens a pool of at most maxConns connections to the test database and
// closes it when the test ends. It fails the test if Postgres does not answer.
func Pool(tb testing.TB, maxConns int32) *pgxpool.Pool {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig(URL())
	if err != nil {
		tb.Fatalf("testdb: parse IDEMQ_TEST_POSTGRES_URL: %v", err)
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	return open(tb, cfg, "Postgres is not reachable (run `make up`, or set IDEMQ_TEST_POSTGRES_URL)")
}

// open opens a pool with cfg, checks that Postgres answers (else it fails
// the test with unreachable), and closes the pool when the test ends.
func open(tb testing.TB, cfg *pgxpool.Config, unreachable string) *pgxpool.Pool {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		tb.Fatalf("testdb: %s: %v", unreachable, err)
	}
	tb.Cleanup(pool.Close)
	return pool
}

// cleanupTimeout bounds dropping a test's schema.
const cleanupTimeout = 30 * time.Second

// Schema returns a fresh, unique schema name for one test, not created,
// and drops the schema (and everything in it), if something created it,
// when the test ends, on a connection of its own (the pool may be closed by
// then). Most tests want deduptest.Schema, migrated.
func Schema(tb testing.TB, pool *pgxpool.Pool) string {
	tb.Helper()
	name := "idemq_t_" + RandomHex(6)
	connConfig := pool.Config().ConnConfig
	tb.Cleanup(func() { drop(tb, connConfig, name) })
	return name
}

// drop drops schema on a connection of its own.
func drop(tb testing.TB, connConfig *pgx.ConnConfig, schema string) {
	ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
	defer cancel()
	conn, err := pgx.ConnectConfig(ctx, connConfig)
	if err != nil {
		tb.Logf("testdb: drop schema %s: %v", schema, err)
		return
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
		tb.Logf("testdb: drop schema %s: %v", schema, err)
	}
}

// RandomHex returns n random bytes as hex, for unique names in tests.
func RandomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Listen LISTENs on channel on a direct connection (a LISTEN needs a
// session) and returns the payloads of its notifications, in the order
// Postgres delivers them (commit order), until the test ends.
func Listen(tb testing.TB, channel string) <-chan string {
	tb.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	conn, err := pgx.ConnectConfig(ctx, Direct(tb))
	if err != nil {
		cancel()
		tb.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{channel}.Sanitize()); err != nil {
		cancel()
		_ = conn.Close(context.Background())
		tb.Fatal(err)
	}
	out := make(chan string, 10000)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			n, err := conn.WaitForNotification(ctx)
			if err != nil {
				return
			}
			out <- n.Payload
		}
	}()
	tb.Cleanup(func() {
		cancel()
		<-done
		_ = conn.Close(context.Background())
	})
	return out
}
