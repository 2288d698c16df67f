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

	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
)

// A handler writes its message into the outbox in the same transaction as
// its business rows: the message exists if and only if the transaction
// commits. In a handler the consumer runs, a message without a MessageID
// gets one derived from the key being handled, the same on every retry;
// outside one, give it the id of the operation.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testdb.URL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	schemaName := "idemq_example_" + testdb.RandomHex(4)
	if err := schema.Migrate(ctx, pool, schemaName); err != nil {
		log.Fatal(err)
	}
	defer pool.Exec(ctx, "DROP SCHEMA "+schemaName+" CASCADE") //nolint:errcheck

	ob, err := outbox.New(pool, &outbox.Config{Schema: schemaName})
	if err != nil {
		log.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// ... charge the card, write the business rows in tx ...
		return ob.Enqueue(ctx, tx, outbox.Message{
			Exchange:    "payments",
			RoutingKey:  "payment.captured",
			ContentType: "application/json",
			Body:        []byte(`{"order":"o-1","amount":4200}`),
			MessageID:   "payment-captured-o-1",
		})
	})
	if err != nil {
		log.Fatal(err)
	}
	b, err := ob.Pending(ctx)
	if err != nil {
		log.Fatal(err)
	}
	var id string
	if err := pool.QueryRow(ctx, "SELECT message_id FROM "+schemaName+".outbox").Scan(&id); err != nil {
		log.Fatal(err)
	}
	fmt.Println("pending:", b.Pending)
	fmt.Println("message id:", id)
	// Output:
	// pending: 1
	// message id: payment-captured-o-1
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
	ob, err := outbox.New(pool, nil) // the outbox in schema.Default
	if err != nil {
		log.Fatal(err)
	}
	relay, err := outbox.NewRelay(ob, "amqp://guest:guest@127.0.0.1:5672/", &outbox.RelayConfig{
		ConnectionName: "billing-relay",
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := relay.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
