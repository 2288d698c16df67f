package dedup_test

import (
	"cmp"
	"context"
	"fmt"
	"log"
	"math/rand/v2"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/schema"
)

// A GC run paced like `idemq gc`: at most 200 keys per statement, a pause
// after each full batch, oldest first. Behind says how far past the
// retention horizon the oldest key still due lies when the run ends: 0 while
// GC keeps up.
func ExampleStore_GC() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, cmp.Or(os.Getenv("IDEMQ_TEST_POSTGRES_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	// A schema of this run's own: examples of two runs may share a database.
	dbSchema := fmt.Sprintf("idemq_example_gc_%08x", rand.Uint32())
	if err := schema.Migrate(ctx, pool, dbSchema); err != nil {
		log.Fatal(err)
	}
	defer pool.Exec(ctx, "DROP SCHEMA "+dbSchema+" CASCADE") //nolint:errcheck
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: dbSchema})
	if err != nil {
		log.Fatal(err)
	}
	// Two days of keys, one an hour, completed when they were created.
	if _, err := pool.Exec(ctx, `INSERT INTO `+dbSchema+`.keys (consumer, key, state, fingerprint, outcome, created_at, completed_at)
SELECT 'payments', 'order-' || h, 'completed', '\x00', 'ok', now() - (h - 0.5) * interval '1 hour', now() - (h - 0.5) * interval '1 hour'
FROM generate_series(1, 48) AS h`); err != nil {
		log.Fatal(err)
	}

	res, err := store.GC(ctx, dedup.GCOptions{Retention: 24 * time.Hour, Pause: dedup.DefaultGCPause})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("deleted %d keys in %d statements (completed, then abandoned), behind %s\n", res.Completed, res.Batches, res.Behind)
	// Output:
	// deleted 24 keys in 2 statements (completed, then abandoned), behind 0s
}
