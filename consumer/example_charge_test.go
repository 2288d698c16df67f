package consumer_test

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"os"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/schema"
)

// processor is a card processor as a payment gateway runs one: a charge
// request carries an idempotency key, and a request with a key it has seen
// returns the charge it made then instead of charging again.
type processor struct {
	mu      sync.Mutex
	calls   int
	charges map[string]string // idempotency key → charge id
}

func (p *processor) Charge(key, card string, amount int64) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	if id, ok := p.charges[key]; ok {
		fmt.Printf("  processor: key seen, charge %s returned again\n", id)
		return id
	}
	id := fmt.Sprintf("ch_%d", len(p.charges)+1)
	p.charges[key] = id
	fmt.Printf("  processor: %s charged %d, charge %s\n", card, amount, id)
	return id
}

// A card charge: the call to the processor runs in a step, with a key
// derived from the message's key for the processor's own deduplication.
// The first attempt fails after the processor charged the card but before
// the step committed (the process died, the database went away): the retry
// calls the processor again with the same derived key, and the processor
// answers with the charge it already made. The second attempt fails after
// the step committed (the receipt could not be sent): the third skips the
// step and does not call the processor at all. One charge in all.
func ExampleDelivery_DerivedKey() {
	ctx := context.Background()
	// In a test: the test's pool and deduptest.Store(t, pool, nil).
	pool, err := pgxpool.New(ctx, cmp.Or(os.Getenv("IDEMQ_TEST_POSTGRES_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	dbSchema := "idemq_example_charge"
	if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+dbSchema+" CASCADE"); err != nil {
		log.Fatal(err)
	}
	if err := schema.Migrate(ctx, pool, dbSchema); err != nil {
		log.Fatal(err)
	}
	defer pool.Exec(context.Background(), "DROP SCHEMA "+dbSchema+" CASCADE") //nolint:errcheck
	if _, err := pool.Exec(ctx, "CREATE TABLE "+dbSchema+".charges (order_id text PRIMARY KEY, charge_id text NOT NULL)"); err != nil {
		log.Fatal(err)
	}
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: dbSchema})
	if err != nil {
		log.Fatal(err)
	}

	gateway := &processor{charges: map[string]string{}}
	charge := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		var p struct {
			Card   string `json:"card"`
			Amount int64  `json:"amount"`
		}
		if err := json.Unmarshal(d.Body, &p); err != nil {
			return consumer.Response{}, consumer.Permanent(err)
		}
		err := d.Step(ctx, "charge", func(ctx context.Context, tx pgx.Tx) error {
			id := gateway.Charge(d.DerivedKey("charge"), p.Card, p.Amount)
			if d.Attempt == 1 {
				return errors.New("connection lost before the step committed")
			}
			// Committed with the recovery point "charge".
			_, err := tx.Exec(ctx, "INSERT INTO "+dbSchema+".charges VALUES ($1, $2)", d.Key, id)
			return err
		})
		if err != nil {
			return consumer.Response{}, err
		}
		var chargeID string
		if err := tx.QueryRow(ctx, "SELECT charge_id FROM "+dbSchema+".charges WHERE order_id = $1", d.Key).Scan(&chargeID); err != nil {
			return consumer.Response{}, err
		}
		if d.Attempt == 2 {
			return consumer.Response{}, errors.New("receipt service unavailable")
		}
		return consumer.Response{Code: 201, Body: []byte(chargeID)}, nil
	}

	t := &testing.T{} // in a test, the test's own
	r := consumertest.NewRunner(store, charge, &consumer.Config{Name: "payments", Steps: true})
	msg := amqp.Publishing{MessageId: "order-1001", Body: []byte(`{"card":"4242","amount":4200}`)}
	for run := 1; ; run++ {
		fmt.Printf("attempt %d:\n", run)
		res := r.Run(t, msg)
		fmt.Printf("  %s, recovery point %q\n", res.Outcome, res.Record.RecoveryPoint)
		if res.Copy == nil {
			fmt.Printf("  response %d %s\n", res.Response.Code, res.Response.Body)
			break
		}
		msg = res.Copy.Publishing // what the retry tier delivers next
	}
	fmt.Println("a redelivery of the message:")
	res := r.Run(t, amqp.Publishing{MessageId: "order-1001", Body: []byte(`{"card":"4242","amount":4200}`)})
	fmt.Printf("  %s, handler called: %v\n", res.Outcome, res.Called)
	fmt.Printf("processor calls: %d, charges: %d\n", gateway.calls, len(gateway.charges))
	// Output:
	// attempt 1:
	//   processor: 4242 charged 4200, charge ch_1
	//   retried, recovery point ""
	// attempt 2:
	//   processor: key seen, charge ch_1 returned again
	//   retried, recovery point "charge"
	// attempt 3:
	//   processed, recovery point "charge"
	//   response 201 ch_1
	// a redelivery of the message:
	//   duplicate, handler called: false
	// processor calls: 2, charges: 1
}
