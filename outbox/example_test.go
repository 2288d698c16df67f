package outbox_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
)

// A handler writes its message into the outbox in the same transaction as
// its business rows: the message exists if and only if the transaction
// commits. Under the claim of the key being handled, its message id is
// derived from the claim, the same on every retry.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testdb.URL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	schema := "idemq_example_" + testdb.RandomHex(4)
	if err := dedup.Migrate(ctx, pool, schema); err != nil {
		log.Fatal(err)
	}
	defer pool.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE") //nolint:errcheck

	// The consumer runtime sets the claim before it runs the handler.
	claim := outbox.Claim{Schema: schema, Consumer: "payments", Key: "charge-o-1"}
	hctx := outbox.WithClaim(ctx, claim)

	err = pgx.BeginFunc(hctx, pool, func(tx pgx.Tx) error {
		// ... charge the card, write the business rows in tx ...
		return outbox.Enqueue(hctx, tx, outbox.Message{
			Exchange:    "payments",
			RoutingKey:  "payment.captured",
			ContentType: "application/json",
			Body:        []byte(`{"order":"o-1","amount":4200}`),
		})
	})
	if err != nil {
		log.Fatal(err)
	}
	b, err := outbox.Pending(ctx, pool, schema)
	if err != nil {
		log.Fatal(err)
	}
	var id string
	if err := pool.QueryRow(ctx, "SELECT message_id FROM "+schema+".outbox").Scan(&id); err != nil {
		log.Fatal(err)
	}
	fmt.Println("pending:", b.Pending)
	fmt.Println("message id:", id, id == outbox.MessageID(claim, 1))
	// Output:
	// pending: 1
	// message id: idemq-ac9a7d49858c321b7d16c5fb443098f4 true
}

// A relay runs until its context ends (here SIGINT or SIGTERM), then
// finishes its batch and returns.
func ExampleRelay_Run() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:5432/postgres")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	relay, err := outbox.NewRelay(pool, "amqp://guest:guest@127.0.0.1:5672/", &outbox.RelayConfig{
		ConnectionName: "billing-relay",
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := relay.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
