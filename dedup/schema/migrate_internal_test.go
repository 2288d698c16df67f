package schema

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/internal/testdb"
)

func TestEmbeddedMigrationsLoad(t *testing.T) {
	t.Parallel()
	if migrationsErr != nil {
		t.Fatal(migrationsErr)
	}
	for i, m := range migrations {
		if m.version != i+1 {
			t.Fatalf("migration %d is %s", i+1, m.name)
		}
		if strings.Contains(m.sql, "drop below") {
			t.Fatalf("migration %s: the down part is in what Migrate applies", m.name)
		}
	}
}

func TestLoadRefusesMalformedFiles(t *testing.T) {
	t.Parallel()
	for name, fsys := range map[string]fstest.MapFS{
		"gap":         {"migrations/001_a.sql": {Data: []byte("SELECT 1")}, "migrations/003_c.sql": {Data: []byte("SELECT 1")}},
		"from two":    {"migrations/002_b.sql": {Data: []byte("SELECT 1")}},
		"bad name":    {"migrations/001-a.sql": {Data: []byte("SELECT 1")}},
		"placeholder": {"migrations/001_a.sql": {Data: []byte("CREATE TABLE {{.Schema}}.t ()")}},
		"empty":       {"migrations/001_a.sql": {Data: []byte("\n" + downMarker + "\nDROP TABLE t;")}},
	} {
		if _, err := load(fsys); err == nil {
			t.Errorf("%s: loaded", name)
		}
	}
}

// terned makes schema as jackc/tern left it at version k: its version
// table, made by tern's own statement, and the first k migrations applied
// with the schema substituted by tern's template.
func terned(t *testing.T, pool *pgxpool.Pool, schema string, k int) {
	t.Helper()
	ctx := context.Background()
	ident := pgx.Identifier{schema}.Sanitize()
	table := ident + ".schema_version"
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+ident); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, fmt.Sprintf(`
    create table if not exists %s(version int4 not null);

    insert into %s(version)
    select 0
    where 0=(select count(*) from %s);
  `, table, table, table)); err != nil {
		t.Fatalf("tern's version table: %v", err)
	}
	for _, m := range migrations[:k] {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, strings.ReplaceAll(m.sql, placeholder, ident)); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "update "+table+" set version=$1", m.version)
			return err
		})
		if err != nil {
			t.Fatalf("apply %s as tern did: %v", m.name, err)
		}
	}
}

// describe lists the columns, indexes, triggers and table options of the
// tables in schema, with the schema's name left out, to compare two schemas.
func describe(t *testing.T, pool *pgxpool.Pool, schema string) string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `
SELECT 'column ' || table_name || '.' || column_name || ' ' || data_type || ' ' || is_nullable || ' ' || coalesce(column_default, '')
FROM information_schema.columns WHERE table_schema = $1
UNION ALL
SELECT 'index ' || replace(indexdef, quote_ident($1) || '.', '') FROM pg_indexes WHERE schemaname = $1
UNION ALL
SELECT 'trigger ' || tgname || ' ' || replace(pg_get_triggerdef(tg.oid), quote_ident($1) || '.', '')
FROM pg_trigger tg JOIN pg_class c ON c.oid = tg.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND NOT tg.tgisinternal
UNION ALL
SELECT 'options ' || c.relname || ' ' || coalesce(array_to_string(c.reloptions, ','), '')
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relkind = 'r'
ORDER BY 1`, schema)
	if err != nil {
		t.Fatal(err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return strings.Join(lines, "\n")
}

// A schema that the earlier, tern-based code migrated to any version
// continues from there: Migrate applies the rest, each once, and the result
// is the schema a fresh Migrate makes, rows kept.
func TestMigrateTakesOverASchemaMigratedByTern(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, 4)
	ctx := context.Background()
	fresh := testdb.Schema(t, pool)
	if err := Migrate(ctx, pool, fresh); err != nil {
		t.Fatal(err)
	}
	want := describe(t, pool, fresh)
	for _, part := range []string{"column keys.recovery_point", "index CREATE INDEX keys_created_at_idx", "options keys fillfactor=70", "column outbox.headers_amqp"} {
		if !strings.Contains(want, part) {
			t.Fatalf("description of a fresh schema lacks %q:\n%s", part, want)
		}
	}
	// The outbox's insert trigger is gone (migration 014): the writers
	// wake the relays themselves.
	if strings.Contains(want, "trigger ") {
		t.Fatalf("a fresh schema has a trigger:\n%s", want)
	}
	for k := range len(migrations) + 1 {
		t.Run(fmt.Sprintf("at version %d", k), func(t *testing.T) {
			t.Parallel()
			name := testdb.Schema(t, pool)
			terned(t, pool, name, k)
			ident := pgx.Identifier{name}.Sanitize()
			if k >= 1 { // a key written before the upgrade
				if _, err := pool.Exec(ctx, "INSERT INTO "+ident+".keys (consumer, key, state, fingerprint) VALUES ('c', 'before', 'completed', '\\x00')"); err != nil {
					t.Fatal(err)
				}
			}
			if applied, _, err := Version(ctx, pool, name); err != nil || applied != k {
				t.Fatalf("version before = %d, %v; want %d", applied, err, k)
			}
			if err := Migrate(ctx, pool, name); err != nil {
				t.Fatalf("migrate from version %d: %v", k, err)
			}
			if applied, known, err := Version(ctx, pool, name); err != nil || applied != known {
				t.Fatalf("version after = %d of %d, %v", applied, known, err)
			}
			if got := describe(t, pool, name); got != want {
				t.Fatalf("schema upgraded from version %d differs from a fresh one:\n%s\n\nwant:\n%s", k, got, want)
			}
			var rows int
			if err := pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM "+ident+".schema_version) + (SELECT count(*) FROM "+ident+".header_keys)").Scan(&rows); err != nil || rows != 2 {
				t.Fatalf("one version row and one header key: %d rows, %v", rows, err)
			}
			if k >= 1 {
				var key string
				if err := pool.QueryRow(ctx, "SELECT key FROM "+ident+".keys").Scan(&key); err != nil || key != "before" {
					t.Fatalf("key written before the upgrade: %q, %v", key, err)
				}
			}
		})
	}
}

// A migration that fails leaves nothing behind: neither its own changes nor
// a version bump; the ones before it stay applied.
func TestFailedMigrationRollsBackWithItsVersion(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, 2)
	ctx := context.Background()
	name := testdb.Schema(t, pool)
	bad := append(append([]migration(nil), migrations...), migration{
		version: len(migrations) + 1, name: "999_bad.sql",
		sql: "CREATE TABLE " + placeholder + ".half (x int); SELECT 1/0;",
	})
	err := migrate(ctx, pool, name, bad)
	if err == nil || !strings.Contains(err.Error(), "999_bad.sql") {
		t.Fatalf("migrate with a failing migration: %v", err)
	}
	if applied, known, err := Version(ctx, pool, name); err != nil || applied != known {
		t.Fatalf("version = %d of %d, %v: want the good migrations applied", applied, known, err)
	}
	var half *string
	if err := pool.QueryRow(ctx, "SELECT to_regclass($1)::text", name+".half").Scan(&half); err != nil || half != nil {
		t.Fatalf("table of the failed migration: %v, %v", half, err)
	}
}
