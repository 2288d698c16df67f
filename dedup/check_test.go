package dedup_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/testdb"
)

// TestCheckRefusesAnUnmigratedOrOldSchema: Check passes on a migrated
// schema and refuses, with ErrNotMigrated and the command to run, a schema
// that was never migrated and one an older build left behind.
func TestCheckRefusesAnUnmigratedOrOldSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	store, pool := newStore(t, 4, nil)
	if err := store.Check(ctx); err != nil {
		t.Fatalf("check of a migrated schema: %v", err)
	}

	bare, err := dedup.NewStore(pool, &dedup.Config{Schema: testdb.Schema(t, pool)})
	if err != nil {
		t.Fatal(err)
	}
	err = bare.Check(ctx)
	if !errors.Is(err, dedup.ErrNotMigrated) || !strings.Contains(err.Error(), "idemq migrate") {
		t.Fatalf("check of an empty schema: %v, want ErrNotMigrated saying to run idemq migrate", err)
	}

	_, known, err := schema.Version(ctx, pool, store.Config().Schema)
	if err != nil {
		t.Fatal(err)
	}
	oldName := testdb.Schema(t, pool)
	if err := schema.MigrateTo(ctx, pool, oldName, known-1); err != nil {
		t.Fatal(err)
	}
	old, err := dedup.NewStore(pool, &dedup.Config{Schema: oldName})
	if err != nil {
		t.Fatal(err)
	}
	err = old.Check(ctx)
	if !errors.Is(err, dedup.ErrNotMigrated) || !strings.Contains(err.Error(), "idemq migrate") {
		t.Fatalf("check of a schema one migration behind: %v, want ErrNotMigrated saying to run idemq migrate", err)
	}
}
