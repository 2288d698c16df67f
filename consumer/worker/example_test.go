package worker_test

import (
	"context"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/worker"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/outbox"
)

// A worker process: the consumer of "payments" and the relay of its outbox,
// stopped together by SIGINT or SIGTERM, which drain before Run returns.
func ExampleNew() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("IDEMQ_POSTGRES_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	store, err := dedup.NewStore(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	charge := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		// The handler's effects in tx, then a receipt the relay sends once tx commits.
		return consumer.Response{Code: 201}, outbox.Enqueue(ctx, tx, outbox.Message{Exchange: "receipts", Body: d.Body})
	}
	w, err := worker.New(store, charge, &worker.Config{
		Consumer: consumer.Config{URL: os.Getenv("IDEMQ_AMQP_URL"), Queue: "payments", Name: "charge"},
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := w.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
