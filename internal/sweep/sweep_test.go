package sweep

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/internal/testdb"
)

// olderThanRetention is the horizon of the test table's rows.
const olderThanRetention = `created_at < now() - $1::bigint * interval '1 microsecond'`

// rowsTable creates a schema of the test's own with a table of random keys
// and a created_at index, as the key table has.
func rowsTable(ctx context.Context, t *testing.T, pool *pgxpool.Pool) (schema, table string) {
	t.Helper()
	schema = testdb.Schema(t, pool)
	table = schema + ".rows"
	execAll(ctx, t, pool,
		`CREATE SCHEMA `+schema,
		`CREATE TABLE `+table+` (k text PRIMARY KEY, created_at timestamptz NOT NULL)`,
		`CREATE INDEX rows_created_at_idx ON `+table+` (created_at)`)
	return schema, table
}

func execAll(ctx context.Context, t *testing.T, pool *pgxpool.Pool, sqls ...string) {
	t.Helper()
	for _, sql := range sqls {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
}

// GC's DELETE reaches the rows it picked by their place in the heap. Joined
// back through the primary key, a batch of 1,000 rows of a table with random
// keys (idemq's key table) reads about as many random index pages: at 10 M
// keys that was 18 ms a batch and 1,800 pages read into the shared buffers
// the workers use; by ctid, 1 ms and none (docs/operations.md, "Retention at
// scale"). The plan must read the picked rows with a Tid Scan and never
// touch the primary key's index.
func TestDeleteReachesRowsByTheirPlaceNotThroughTheKey(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := testdb.Pool(t, 2)
	_, table := rowsTable(ctx, t, pool)
	inserted := time.Now()
	execAll(ctx, t, pool,
		`INSERT INTO `+table+` SELECT md5(i::text), now() - i * interval '1 second' FROM generate_series(1, 20000) AS i`,
		`ANALYZE `+table)
	del := DeleteSQL(table, olderThanRetention, "created_at")
	rows, err := pool.Query(ctx, "EXPLAIN (COSTS OFF) "+del, time.Hour.Microseconds(), 1000)
	if err != nil {
		t.Fatal(err)
	}
	var plan []string
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			t.Fatal(err)
		}
		plan = append(plan, line)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	text := strings.Join(plan, "\n")
	if !strings.Contains(text, "Tid Scan") || strings.Contains(text, "rows_pkey") {
		t.Fatalf("the delete should read its rows with a Tid Scan and not through rows_pkey:\n%s", text)
	}
	// And it deletes what it picked: the oldest, at most $2 of them.
	tag, err := pool.Exec(ctx, del, time.Hour.Microseconds(), 1000)
	if err != nil || tag.RowsAffected() != 1000 {
		t.Fatalf("delete: %v, %d rows, want 1000", err, tag.RowsAffected())
	}
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table+` WHERE created_at < now() - interval '1 hour'`).Scan(&left); err != nil {
		t.Fatal(err)
	}
	// One row a second crosses the horizon while the test runs.
	if want, late := 20000-3600-1000, int(time.Since(inserted).Seconds())+2; left < want-2 || left > want+late {
		t.Fatalf("%d rows older than an hour left, want about %d", left, want)
	}
}

// A run's deletes compress their WAL where the role may set wal_compression
// (a superuser here) and run uncompressed, without failing, where it may
// not; the setting is the deletes' transactions' own, so that the session
// (or, through a pooler, whichever backend served them) keeps none of it.
// What each DELETE ran with is recorded by a statement trigger.
func TestRunCompressesItsWALWhereItMay(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := testdb.Pool(t, 2)
	schema, table := rowsTable(ctx, t, pool)
	role := "idemq_t_gc_" + testdb.RandomHex(4)
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP OWNED BY "+role)
		_, _ = pool.Exec(context.Background(), "DROP ROLE IF EXISTS "+role)
	})
	seen := schema + ".deletes_with"
	execAll(ctx, t, pool,
		`CREATE TABLE `+seen+` (wal text)`,
		`CREATE FUNCTION `+schema+`.note() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO `+seen+` VALUES (current_setting('wal_compression')); RETURN NULL; END $$`,
		`CREATE TRIGGER note BEFORE DELETE ON `+table+` FOR EACH STATEMENT EXECUTE FUNCTION `+schema+`.note()`,
		`CREATE ROLE `+role+` LOGIN`,
		`GRANT USAGE ON SCHEMA `+schema+` TO `+role,
		`GRANT SELECT, UPDATE, DELETE ON `+table+` TO `+role,
		`GRANT INSERT ON `+seen+` TO `+role)
	metrics, err := NewMetrics(nil, "test", schema, "rows")
	if err != nil {
		t.Fatal(err)
	}
	steps := []Step{{Kind: "old", SQL: DeleteSQL(table, olderThanRetention, "created_at")}}
	behind := `SELECT 0::bigint WHERE $1::bigint IS NOT NULL`
	for _, tc := range []struct {
		user string
		want string // wal_compression while deleting
	}{
		{user: "", want: "lz4"}, // the tests' own role, a superuser
		{user: role, want: "off"},
	} {
		execAll(ctx, t, pool, `TRUNCATE `+seen,
			`INSERT INTO `+table+` SELECT md5(random()::text), now() - interval '2 hours' FROM generate_series(1, 500)`)
		cfg, err := pgxpool.ParseConfig(testdb.URL())
		if err != nil {
			t.Fatal(err)
		}
		if tc.user != "" {
			cfg.ConnConfig.User = tc.user
		}
		cfg.MaxConns = 1
		runner, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		var before string
		if err := runner.QueryRow(ctx, "SHOW wal_compression").Scan(&before); err != nil {
			t.Fatal(err)
		}
		res, err := Run(ctx, runner, metrics, steps, behind, Options{Retention: time.Hour, Batch: 200})
		if err != nil {
			t.Fatalf("as %q: %v", tc.user, err)
		}
		if res.Deleted[0] != 500 {
			t.Fatalf("as %q: deleted %d, want 500", tc.user, res.Deleted[0])
		}
		rows, err := pool.Query(ctx, "SELECT wal FROM "+seen)
		if err != nil {
			t.Fatal(err)
		}
		deletesWith, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil || len(deletesWith) != res.Batches {
			t.Fatalf("as %q: %d deletes recorded, %d ran (%v)", tc.user, len(deletesWith), res.Batches, err)
		}
		for i, got := range deletesWith {
			if got != tc.want && !(tc.want == "lz4" && got == "pglz") {
				t.Fatalf("as %q: delete %d ran with wal_compression %s, want %s", tc.user, i, got, tc.want)
			}
		}
		var after string
		if err := runner.QueryRow(ctx, "SHOW wal_compression").Scan(&after); err != nil || after != before {
			t.Fatalf("as %q: wal_compression %q after the run, %q before (%v)", tc.user, after, before, err)
		}
		runner.Close()
	}
}
