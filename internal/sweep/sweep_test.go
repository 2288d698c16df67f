package sweep

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testdb"
)

// GC's DELETE reaches the rows it picked by their place in the heap. Joined
// back through the primary key, a batch of 1,000 rows of a table with random
// keys (idemq's key table) reads about as many random index pages: at 10 M
// keys that was 18 ms a batch, 1,800 pages read into shared buffers out of
// the workers' way, and the workers' p99 rose by 14-61 % while GC deleted
// (docs/operations.md, "Retention at scale"). The plan must read the picked
// rows with a Tid Scan and never touch the primary key's index.
func TestDeleteReachesRowsByTheirPlaceNotThroughTheKey(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := testdb.Pool(t, 2)
	schema := testdb.Schema(t, pool)
	table := schema + ".rows"
	for _, sql := range []string{
		`CREATE SCHEMA ` + schema,
		`CREATE TABLE ` + table + ` (k text PRIMARY KEY, created_at timestamptz NOT NULL)`,
		`CREATE INDEX rows_created_at_idx ON ` + table + ` (created_at)`,
		`INSERT INTO ` + table + ` SELECT md5(i::text), now() - i * interval '1 second' FROM generate_series(1, 20000) AS i`,
		`ANALYZE ` + table,
	} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	del := DeleteSQL(table, `created_at < now() - $1::bigint * interval '1 microsecond'`, "created_at")
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
	if want := 20000 - 3600 - 1000; left < want-2 || left > want+2 {
		t.Fatalf("%d rows older than an hour left, want about %d", left, want)
	}
}
