package dedup_test

import (
	"cmp"
	"context"
	"fmt"
	"log"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/schema"
)

// The reserve → complete flow: the first delivery acquires the key and
// completes it in the transaction that holds its effects; a redelivery is a
// duplicate that gets the stored response back without running anything.
func Example() {
	ctx := context.Background()
	// The database the tests use (IDEMQ_TEST_POSTGRES_URL, else the local one).
	pool, err := pgxpool.New(ctx, cmp.Or(os.Getenv("IDEMQ_TEST_POSTGRES_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	dbSchema := "idemq_example"
	if err := schema.Migrate(ctx, pool, dbSchema); err != nil {
		log.Fatal(err)
	}
	defer pool.Exec(ctx, "DROP SCHEMA "+dbSchema+" CASCADE") //nolint:errcheck
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: dbSchema})
	if err != nil {
		log.Fatal(err)
	}

	body := []byte(`{"order":"o-1","amount":4200}`)
	fp, _ := dedup.BodyFingerprint(body)
	c := dedup.Claim{Scope: dedup.Scope{Consumer: "payments", Key: "charge-o-1"}, Fingerprint: fp}

	for delivery := 1; delivery <= 2; delivery++ {
		r, err := store.Reserve(ctx, c)
		if err != nil {
			log.Fatal(err)
		}
		switch r.Decision {
		case dedup.Acquired:
			err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				// ... charge the card, write the business rows in tx ...
				return store.Complete(ctx, tx, r.Lease, dedup.Result{Outcome: dedup.OutcomeOK, Response: []byte("charged")})
			})
			if err != nil {
				log.Fatal(err)
			}
			fmt.Printf("delivery %d: processed\n", delivery)
		case dedup.Duplicate:
			fmt.Printf("delivery %d: duplicate, stored response %q\n", delivery, r.Record.Result.Response)
		}
	}
	// Output:
	// delivery 1: processed
	// delivery 2: duplicate, stored response "charged"
}
