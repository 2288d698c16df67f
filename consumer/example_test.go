package consumer_test

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"log"
	"log/slog"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/schema"
)

// A payment handler in a few lines: the charge row and the key's completion
// commit together; the redelivered copy never reaches the handler.
func Example() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The services the tests use (IDEMQ_TEST_*_URL, else the local ones).
	pgURL := cmp.Or(os.Getenv("IDEMQ_TEST_POSTGRES_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	amqpURL := cmp.Or(os.Getenv("IDEMQ_TEST_AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")
	pool, err := pgxpool.New(ctx, pgURL)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	dbSchema, queue := "idemq_example_consumer", "example.payments"
	if err := schema.Migrate(ctx, pool, dbSchema); err != nil {
		log.Fatal(err)
	}
	defer pool.Exec(context.Background(), "DROP SCHEMA "+dbSchema+" CASCADE")                     //nolint:errcheck
	pool.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+dbSchema+".charges (order_id text, body jsonb)") //nolint:errcheck
	store, _ := dedup.NewStore(pool, &dedup.Config{Schema: dbSchema})

	outcomes := make(chan consumer.Outcome, 2)
	charge := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		_, err := tx.Exec(ctx, "INSERT INTO "+dbSchema+".charges VALUES ($1, $2)", d.Key, d.Body)
		return consumer.Response{Code: 201}, err
	}
	cfg := &consumer.Config{
		URL: amqpURL, Queue: queue, Name: "charge",
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
		OnOutcome: func(e consumer.Event) { outcomes <- e.Outcome },
	}
	if err := consumer.Apply(ctx, cfg.URL, cfg.TopologyConfig()); err != nil { // or: idemq topology apply --queue example.payments
		log.Fatal(err)
	}
	c, err := consumer.New(store, charge, cfg)
	if err != nil {
		log.Fatal(err)
	}
	done := make(chan error)
	go func() { done <- c.Run(ctx) }()

	conn, _ := amqp.Dial(amqpURL)
	defer conn.Close()
	ch, _ := conn.Channel()
	defer deleteTopology(ch, c.Topology())
	for range 2 { // the publisher retries: the same message_id twice
		ch.PublishWithContext(ctx, "", queue, false, false, amqp.Publishing{MessageId: "order-1001", Body: []byte(`{"amount":4200}`)}) //nolint:errcheck
		select {
		case o := <-outcomes:
			fmt.Println(o)
		case <-time.After(30 * time.Second):
			fmt.Println("no outcome within 30s")
		}
	}
	cancel()
	if err := <-done; err != nil {
		log.Fatal(err)
	}
	var charges int
	pool.QueryRow(context.Background(), "SELECT count(*) FROM "+dbSchema+".charges").Scan(&charges) //nolint:errcheck
	fmt.Println("charges:", charges)
	// Output:
	// processed
	// duplicate
	// charges: 1
}

func deleteTopology(ch *amqp.Channel, t consumer.Topology) {
	ch.QueueDelete(t.Queue, false, false, false) //nolint:errcheck
	ch.QueueDelete(t.DLQ, false, false, false)   //nolint:errcheck
	for _, d := range t.Delays {
		ch.QueueDelete(t.TierName(d), false, false, false) //nolint:errcheck
	}
	ch.ExchangeDelete(t.DLX, false, false) //nolint:errcheck
}
