package consumertest_test

import (
	"cmp"
	"context"
	"crypto/rand"
	"fmt"
	"log"
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/outbox"
)

// chargeWithReceipt is chargeRight that also writes a receipt of the order
// into the outbox, in the handler's transaction, routed to queue.
func chargeWithReceipt(s *shop, queue string) consumer.Handler {
	charge := chargeRight(s)
	return func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		resp, err := charge(ctx, tx, d)
		if err != nil {
			return resp, err
		}
		return resp, outbox.Enqueue(ctx, tx, outbox.Message{RoutingKey: queue, Body: []byte(d.Key)})
	}
}

// receiptsApplied counts the receipts a downstream applied per order:
// every message it got, or, deduplicating, one per message_id.
func receiptsApplied(msgs []amqp.Delivery, dedupByID bool) error {
	seen := map[string]bool{}
	applied := 0
	for _, m := range msgs {
		if dedupByID && seen[m.MessageId] {
			continue
		}
		seen[m.MessageId] = true
		applied++
	}
	if applied != 1 {
		return fmt.Errorf("receipt applied %d times", applied)
	}
	return nil
}

// The card charge done right also writes a receipt into the outbox. With a
// Downstream, CrashPoints relays it with a real relay, and crashes the
// relay after the broker's confirms, before it marks the row: the next
// relay publishes the receipt again, with the same message_id. A
// downstream that applies every message it gets is caught there; one that
// deduplicates by message_id passes every point.
func ExampleCrashPoints_downstream() {
	ctx := context.Background()
	pcfg, err := pgxpool.ParseConfig(cmp.Or(os.Getenv("IDEMQ_TEST_POSTGRES_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		log.Fatal(err)
	}
	pcfg.MaxConns = 64 // room for the points to run at once
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	amqpURL := cmp.Or(os.Getenv("IDEMQ_TEST_AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		log.Fatal(err)
	}

	var schemas, queues []string
	defer func() {
		for _, s := range schemas {
			pool.Exec(ctx, "DROP SCHEMA "+s+" CASCADE") //nolint:errcheck
		}
		for _, q := range queues {
			ch.QueueDelete(q, false, false, false) //nolint:errcheck
		}
	}()
	setup := func(dedupByID bool) func(testing.TB) consumertest.Subject {
		return func(testing.TB) consumertest.Subject {
			// A name of its own: another run of the example may be going on.
			name := "idemq_example_receipts_" + strings.ToLower(rand.Text()[:8])
			pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+name+" CASCADE") //nolint:errcheck
			if err := schema.Migrate(ctx, pool, name); err != nil {
				log.Fatal(err)
			}
			schemas = append(schemas, name)
			// The receipts' queue: the Subject's own, empty.
			if _, err := ch.QueueDelete(name, false, false, false); err != nil {
				log.Fatal(err)
			}
			if _, err := ch.QueueDeclare(name, false, false, false, false, nil); err != nil {
				log.Fatal(err)
			}
			queues = append(queues, name)
			s := &shop{pool: pool, ledger: name + ".ledger", processor: newCardProcessor()}
			if _, err := pool.Exec(ctx, "CREATE TABLE "+s.ledger+" (order_id text, charge_id text)"); err != nil {
				log.Fatal(err)
			}
			store, err := dedup.NewStore(pool, &dedup.Config{Schema: name})
			if err != nil {
				log.Fatal(err)
			}
			return consumertest.Subject{
				Store: store, Handler: chargeWithReceipt(s, name), Check: s.check("order-1001"),
				Config: &consumer.Config{URL: amqpURL, Steps: true},
				Downstream: &consumertest.Downstream{Queue: name,
					Check: func(_ context.Context, msgs []amqp.Delivery) error { return receiptsApplied(msgs, dedupByID) }},
			}
		}
	}
	msg := amqp.Publishing{
		MessageId: "order-1001", Body: []byte(`{"card":"4242","amount":4200}`),
		Headers: amqp.Table{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
	}
	t := &testing.T{} // in a test, the test's own

	byCount := consumertest.CrashPoints(t, setup(false), msg)
	for _, row := range byCount.Rows {
		if row.Err != nil {
			fmt.Println("applied by count: caught", row.Point+":", row.Err)
		}
	}
	fmt.Println(byCount)
	byID := consumertest.CrashPoints(t, setup(true), msg)
	fmt.Println("\ndeduplicated by message_id: every point passed:", !byID.Failed())
	fmt.Println(byID)
	// Output:
	// applied by count: caught after the relay publishes, before it marks the row: receipt applied 2 times
	// point                                                    result                           trace
	// no crash                                                 passed                           -
	// after the reservation                                    passed                           0af7651916cd43dd8448eb211c80319c
	// in step charge, before its commit                        passed                           0af7651916cd43dd8448eb211c80319c
	// after step charge commits                                passed                           0af7651916cd43dd8448eb211c80319c
	// after the handler, before COMMIT                         passed                           0af7651916cd43dd8448eb211c80319c
	// after COMMIT, before the ack                             passed                           0af7651916cd43dd8448eb211c80319c
	// after an outbox row commits, before the relay publishes  passed                           0af7651916cd43dd8448eb211c80319c
	// after the relay publishes, before it marks the row       FAILED: receipt applied 2 times  0af7651916cd43dd8448eb211c80319c
	// a second copy during the first                           passed                           0af7651916cd43dd8448eb211c80319c
	// a second copy after the first                            passed                           0af7651916cd43dd8448eb211c80319c
	// the lease expires under a slow handler                   passed                           0af7651916cd43dd8448eb211c80319c
	//
	// deduplicated by message_id: every point passed: true
	// point                                                    result  trace
	// no crash                                                 passed  -
	// after the reservation                                    passed  0af7651916cd43dd8448eb211c80319c
	// in step charge, before its commit                        passed  0af7651916cd43dd8448eb211c80319c
	// after step charge commits                                passed  0af7651916cd43dd8448eb211c80319c
	// after the handler, before COMMIT                         passed  0af7651916cd43dd8448eb211c80319c
	// after COMMIT, before the ack                             passed  0af7651916cd43dd8448eb211c80319c
	// after an outbox row commits, before the relay publishes  passed  0af7651916cd43dd8448eb211c80319c
	// after the relay publishes, before it marks the row       passed  0af7651916cd43dd8448eb211c80319c
	// a second copy during the first                           passed  0af7651916cd43dd8448eb211c80319c
	// a second copy after the first                            passed  0af7651916cd43dd8448eb211c80319c
	// the lease expires under a slow handler                   passed  0af7651916cd43dd8448eb211c80319c
}
