package deduptest_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/deduptest"
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/keystore"
	"github.com/idemq/idemq/internal/testdb"
)

// TestSchemaIsMigratedAndDroppedAtCleanup: a test's schema has every
// migration applied, and is gone once the test ends, even when the test
// closed its pool first.
func TestSchemaIsMigratedAndDroppedAtCleanup(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, 2)
	var dbSchema string
	t.Run("inner", func(t *testing.T) {
		inner, err := pgxpool.NewWithConfig(context.Background(), pool.Config())
		if err != nil {
			t.Fatal(err)
		}
		dbSchema = deduptest.Schema(t, inner)
		applied, known, err := schema.Version(context.Background(), inner, dbSchema)
		if err != nil || applied != known || known == 0 {
			t.Fatalf("schema version %d of %d (%v), want every migration applied", applied, known, err)
		}
		inner.Close() // before the cleanup drops the schema
	})
	if exists(t, pool, dbSchema) {
		t.Fatalf("schema %s still exists after its test ended", dbSchema)
	}
}

// TestStoreTakesTheConfigButItsSchema: Store configures the store with cfg,
// on a fresh schema of its own.
func TestStoreTakesTheConfigButItsSchema(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, 2)
	store := deduptest.Store(t, pool, &dedup.Config{Schema: "idemq", Lease: 7 * time.Second})
	if cfg := store.Config(); cfg.Schema == "idemq" || cfg.Lease != 7*time.Second {
		t.Fatalf("store config %+v: want a fresh dbSchema and the lease asked for", cfg)
	}
	if _, err := keystore.Of(store).HeaderKeys(context.Background()); err != nil {
		t.Fatalf("the store's dbSchema is not usable: %v", err)
	}
}

// TestSchemaNameCreatesNothing: the name is fresh and unused; a schema
// created under it is dropped when the test ends.
func TestSchemaNameCreatesNothing(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, 2)
	var dbSchema string
	t.Run("inner", func(t *testing.T) {
		dbSchema = deduptest.SchemaName(t, pool)
		if exists(t, pool, dbSchema) {
			t.Fatalf("schema %s exists before anything created it", dbSchema)
		}
		if err := schema.Migrate(context.Background(), pool, dbSchema); err != nil {
			t.Fatal(err)
		}
	})
	if exists(t, pool, dbSchema) {
		t.Fatalf("schema %s still exists after its test ended", dbSchema)
	}
}

func exists(t *testing.T, pool *pgxpool.Pool, dbSchema string) bool {
	t.Helper()
	var ok bool
	err := pool.QueryRow(context.Background(), "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", dbSchema).Scan(&ok)
	if err != nil {
		t.Fatal(err)
	}
	return ok
}
