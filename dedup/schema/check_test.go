package schema_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/testdb"
)

// TestCheck: a schema never migrated and one a migration behind are
// refused with ErrNotMigrated and the command to run; a migrated one and
// one a later build migrated further pass.
func TestCheck(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, 2)
	k := known(t, pool)
	for _, tc := range []struct {
		name    string
		version int // migrated to; -1: never
		refused bool
	}{
		{"never migrated", -1, true},
		{"a migration behind", k - 1, true},
		{"migrated", k, false},
		{"migrated further", k + 1, false},
	} {
		name := testdb.Schema(t, pool)
		if tc.version >= 0 {
			if err := schema.MigrateTo(ctx, pool, name, min(tc.version, k)); err != nil {
				t.Fatal(err)
			}
		}
		if tc.version > k {
			if _, err := pool.Exec(ctx, "UPDATE "+name+".schema_version SET version = $1", tc.version); err != nil {
				t.Fatal(err)
			}
		}
		err := schema.Check(ctx, pool, name)
		if tc.refused != (err != nil) {
			t.Fatalf("%s: Check = %v; want refused %v", tc.name, err, tc.refused)
		}
		if tc.refused && (!errors.Is(err, schema.ErrNotMigrated) || !strings.Contains(err.Error(), "idemq migrate --schema "+name)) {
			t.Fatalf("%s: Check = %v; want ErrNotMigrated saying to run idemq migrate --schema %s", tc.name, err, name)
		}
	}
}
