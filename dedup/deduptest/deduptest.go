// Package deduptest gives tests of code built on idemq a Postgres schema
// of their own: fresh, migrated with idemq's tables, and dropped when the
// test ends, so that tests run in parallel against one database without
// seeing each other's keys or outbox rows.
//
// The caller brings the database (a pool); the package reads no
// environment variable.
package deduptest

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/testdb"
)

// cleanupTimeout bounds dropping a test's schema.
const cleanupTimeout = 30 * time.Second

// Schema creates a fresh schema with idemq's tables (schema.Migrate) in the
// database of pool, for one test, and returns its name. The schema and
// everything in it are dropped when the test ends, on a connection of its
// own, so the pool may be closed by then. It fails the test if the
// migration fails.
func Schema(tb testing.TB, pool *pgxpool.Pool) string {
	tb.Helper()
	name := SchemaName(tb, pool)
	ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
	defer cancel()
	if err := schema.Migrate(ctx, pool, name); err != nil {
		tb.Fatalf("deduptest: %v", err)
	}
	return name
}

// Store returns a store of pool on a fresh Schema. cfg (nil for defaults)
// configures it, except for its Schema.
func Store(tb testing.TB, pool *pgxpool.Pool, cfg *dedup.Config) *dedup.Store {
	tb.Helper()
	var c dedup.Config
	if cfg != nil {
		c = *cfg
	}
	c.Schema = Schema(tb, pool)
	store, err := dedup.NewStore(pool, &c)
	if err != nil {
		tb.Fatalf("deduptest: %v", err)
	}
	return store
}

// SchemaName returns a fresh schema name for one test without creating
// anything (for tests of migrations themselves, or of what happens before
// them), and drops the schema, if something created it, when the test ends.
func SchemaName(tb testing.TB, pool *pgxpool.Pool) string {
	tb.Helper()
	return testdb.Schema(tb, pool)
}
