package dedup_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/keystore"
	"github.com/idemq/idemq/internal/testdb"
)

// TestHeaderKeys: migrating a schema creates one random 32-byte key, once;
// another schema gets another key; a rotation's key comes first; a schema
// without the table is reported as not migrated.
func TestHeaderKeys(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	store, pool := newStore(t, 4, nil)
	keys, err := keystore.Of(store).HeaderKeys(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) != 1 || len(keys[0].Secret) != 32 || keys[0].SignsFrom.After(time.Now()) {
		t.Fatalf("keys after migrate: %d, want one of 32 bytes that signs now", len(keys))
	}
	if err := schema.Migrate(ctx, pool, store.Config().Schema); err != nil {
		t.Fatal(err)
	}
	again, err := keystore.Of(store).HeaderKeys(ctx)
	if err != nil || len(again) != 1 || !bytes.Equal(again[0].Secret, keys[0].Secret) {
		t.Fatalf("keys after a second migrate: %d, %v; want the same one", len(again), err)
	}
	other, _ := newStore(t, 2, nil)
	otherKeys, err := keystore.Of(other).HeaderKeys(ctx)
	if err != nil || len(otherKeys) != 1 || bytes.Equal(otherKeys[0].Secret, keys[0].Secret) {
		t.Fatalf("another schema's keys: %d, %v; want one other key", len(otherKeys), err)
	}

	// A rotation: a key that signs from tomorrow comes first.
	if _, err := pool.Exec(ctx, "INSERT INTO "+store.Config().Schema+".header_keys (secret, signs_from) VALUES ($1, now() + interval '1 day')",
		bytes.Repeat([]byte{7}, 32)); err != nil {
		t.Fatal(err)
	}
	rotated, err := keystore.Of(store).HeaderKeys(ctx)
	if err != nil || len(rotated) != 2 || rotated[0].Secret[0] != 7 || !bytes.Equal(rotated[1].Secret, keys[0].Secret) {
		t.Fatalf("keys during a rotation: %d, %v; want the new one first", len(rotated), err)
	}

	bare, err := dedup.NewStore(pool, &dedup.Config{Schema: testdb.Schema(t, pool)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := keystore.Of(bare).HeaderKeys(ctx); !errors.Is(err, dedup.ErrNotMigrated) {
		t.Fatalf("keys of a schema never migrated: %v, want ErrNotMigrated", err)
	}
}
