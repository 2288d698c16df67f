package consumertest_test

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/schema"
)

// A handler in two steps: the stock is reserved, then the card charged
// with a key derived for the gateway. The first run fails at the charge and
// is retried; its retry copy skips the committed step and completes with
// the same gateway key; a redelivery after that is a duplicate that never
// reaches the handler.
func ExampleRunHandler() {
	ctx := context.Background()
	// In a test: the test's pool, deduptest.Store(t, pool, nil) for the
	// store, and the test's t.
	pool, err := pgxpool.New(ctx, cmp.Or(os.Getenv("IDEMQ_TEST_POSTGRES_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	dbSchema := "idemq_example_consumertest"
	pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+dbSchema+" CASCADE") //nolint:errcheck
	if err := schema.Migrate(ctx, pool, dbSchema); err != nil {
		log.Fatal(err)
	}
	defer pool.Exec(ctx, "DROP SCHEMA "+dbSchema+" CASCADE") //nolint:errcheck
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: dbSchema})
	if err != nil {
		log.Fatal(err)
	}
	t := &testing.T{} // in a test, the test's own

	gatewayDown := true
	order := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		err := d.Step(ctx, "reserve-stock", func(ctx context.Context, tx pgx.Tx) error {
			fmt.Println("  stock reserved")
			return nil
		})
		if err != nil {
			return consumer.Response{}, err
		}
		err = d.Step(ctx, "charge", func(ctx context.Context, tx pgx.Tx) error {
			fmt.Println("  charge with gateway key", d.DerivedKey("charge"))
			if gatewayDown {
				return errors.New("gateway unavailable")
			}
			return nil
		})
		return consumer.Response{Code: 201}, err
	}
	r := consumertest.NewRunner(store, order, &consumer.Config{Name: "orders", Steps: true})
	msg := amqp.Publishing{MessageId: "order-1001", Body: []byte(`{"sku":"tea","amount":4200}`)}

	fmt.Println("run 1:")
	res := r.Run(t, msg)
	fmt.Println(res.Outcome, res.Record.RecoveryPoint, res.Copy.RoutingKey)

	gatewayDown = false
	fmt.Println("run 2, the retry copy:")
	res = r.Run(t, res.Copy.Publishing)
	fmt.Println(res.Outcome, "attempt", res.Attempt, "code", res.Response.Code)

	fmt.Println("run 3, a redelivery:")
	res = r.Run(t, msg)
	fmt.Println(res.Outcome, "handler called:", res.Called)
	// Output:
	// run 1:
	//   stock reserved
	//   charge with gateway key idemq-0fd94771bd42410ce3a58d51be38068cf0
	// retried reserve-stock consumertest.retry.1s
	// run 2, the retry copy:
	//   charge with gateway key idemq-0fd94771bd42410ce3a58d51be38068cf0
	// processed attempt 2 code 201
	// run 3, a redelivery:
	// duplicate handler called: false
}
