package outbox_test

import (
	"cmp"
	"context"
	"fmt"
	"log"
	"os"
	"os/signal"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/outbox"
)

// A handler writes its message into the outbox in the same transaction as
// its business rows: the message exists if and only if the transaction
// commits. The consumer runtime puts the claim of the key being handled in
// the handler's context, so the message id is derived from the claim, the
// same on every retry. Here consumertest.RunHandler runs the handler as the
// runtime does.
func Example() {
	ctx := context.Background()
	// The database the tests use (IDEMQ_TEST_POSTGRES_URL, else the local one).
	pool, err := pgxpool.New(ctx, cmp.Or(os.Getenv("IDEMQ_TEST_POSTGRES_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	dbSchema := "idemq_example_outbox"
	pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+dbSchema+" CASCADE") //nolint:errcheck
	if err := schema.Migrate(ctx, pool, dbSchema); err != nil {
		log.Fatal(err)
	}
	defer pool.Exec(ctx, "DROP SCHEMA "+dbSchema+" CASCADE") //nolint:errcheck
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: dbSchema})
	if err != nil {
		log.Fatal(err)
	}

	charge := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		// ... charge the card, write the business rows in tx ...
		return consumer.Response{}, outbox.Enqueue(ctx, tx, outbox.Message{
			Exchange:    "payments",
			RoutingKey:  "payment.captured",
			ContentType: "application/json",
			Body:        []byte(`{"order":"o-1","amount":4200}`),
		})
	}
	t := &testing.T{} // in a test, the test's own
	r := consumertest.NewRunner(store, charge, &consumer.Config{Name: "payments"})
	res := r.Run(t, amqp.Publishing{MessageId: "charge-o-1", Body: []byte(`{"order":"o-1"}`)})
	fmt.Println(res.Outcome)

	ob, err := outbox.New(pool, &outbox.Config{Schema: dbSchema})
	if err != nil {
		log.Fatal(err)
	}
	b, err := ob.Pending(ctx)
	if err != nil {
		log.Fatal(err)
	}
	var id string
	if err := pool.QueryRow(ctx, "SELECT message_id FROM "+dbSchema+".outbox").Scan(&id); err != nil {
		log.Fatal(err)
	}
	scope := dedup.Scope{Consumer: "payments", Key: "charge-o-1"}
	fmt.Println("pending:", b.Pending)
	fmt.Println("message id:", id, id == outbox.MessageID(scope, "", 1))
	// Output:
	// processed
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
	ob, err := outbox.New(pool, nil) // the default schema, idemq
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

// A writer that commits its own transactions, many at once, asks for the
// relays' wake-up after the commit: its transactions then send no NOTIFY,
// which Postgres would make commit one at a time, and Wake sends one from
// outside them (one at a time per Outbox, however many commits ask).
// Here a LISTEN on the outbox's channel stands for the relays.
func ExampleWakeAfterCommit() {
	ctx := context.Background()
	// A LISTEN needs a session: where the pool goes through a transaction
	// pooler (PgBouncer), the relays' connection reaches Postgres directly.
	url := cmp.Or(os.Getenv("IDEMQ_TEST_POSTGRES_DIRECT_URL"), os.Getenv("IDEMQ_TEST_POSTGRES_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	dbSchema := "idemq_example_wake"
	pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+dbSchema+" CASCADE") //nolint:errcheck
	if err := schema.Migrate(ctx, pool, dbSchema); err != nil {
		log.Fatal(err)
	}
	defer pool.Exec(ctx, "DROP SCHEMA "+dbSchema+" CASCADE") //nolint:errcheck
	ob, err := outbox.New(pool, &outbox.Config{Schema: dbSchema})
	if err != nil {
		log.Fatal(err)
	}
	relays, err := pool.Acquire(ctx) // what a relay does: LISTEN
	if err != nil {
		log.Fatal(err)
	}
	defer relays.Release()
	if _, err := relays.Exec(ctx, "LISTEN "+outbox.ChannelName(dbSchema)); err != nil {
		log.Fatal(err)
	}

	ctx = outbox.WakeAfterCommit(ctx)
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// ... business rows in tx ...
		return ob.Enqueue(ctx, tx, outbox.Message{RoutingKey: "receipts", Body: []byte("paid")})
	})
	if err != nil {
		log.Fatal(err)
	}
	outbox.Wake(ctx) // after the commit, only when it succeeded; it does not wait

	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	n, err := relays.Conn().WaitForNotification(wctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("relays woken on", n.Channel)
	// Output:
	// relays woken on idemq_example_wake_outbox
}
