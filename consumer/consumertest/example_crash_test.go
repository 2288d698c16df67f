package consumertest_test

import (
	"cmp"
	"context"
	"crypto/rand"
	"fmt"
	"log"
	"os"
	"strconv"
	"strings"
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

// cardProcessor is a fake card processor that deduplicates by idempotency
// key, as a payment gateway does: a request with a key it has seen returns
// the charge it made then instead of charging again. It keeps every charge
// it made, per order, for the check.
type cardProcessor struct {
	mu      sync.Mutex
	byKey   map[string]string   // idempotency key → charge id
	byOrder map[string][]string // order → the charges made for it
	lookups map[string]string   // idempotency key → charge id, for Lookup
}

func newCardProcessor() *cardProcessor {
	return &cardProcessor{byKey: map[string]string{}, byOrder: map[string][]string{}, lookups: map[string]string{}}
}

// Charge charges amount for order, once per idempotency key.
func (p *cardProcessor) Charge(idempotencyKey, order string, amount int64) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if id, ok := p.byKey[idempotencyKey]; ok {
		return id
	}
	id := "ch_" + strconv.Itoa(len(p.byKey)+1)
	p.byKey[idempotencyKey] = id
	p.byOrder[order] = append(p.byOrder[order], id)
	return id
}

// Lookup returns the charge made with idempotencyKey ("" if none).
func (p *cardProcessor) Lookup(idempotencyKey string) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.byKey[idempotencyKey]
}

// Charges returns the charges made for order.
func (p *cardProcessor) Charges(order string) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.byOrder[order]
}

// shop is what a card-charge handler acts on: the processor, and the
// ledger table where each order's charge is booked.
type shop struct {
	pool      *pgxpool.Pool
	ledger    string // the ledger table, schema-qualified
	processor *cardProcessor
}

// book books order's charge in tx.
func (s *shop) book(ctx context.Context, tx pgx.Tx, order, charge string) error {
	_, err := tx.Exec(ctx, "INSERT INTO "+s.ledger+" (order_id, charge_id) VALUES ($1, $2)", order, charge)
	return err
}

// check is the end state every crash must leave: each order charged once
// by the processor, and that charge booked once in the ledger.
func (s *shop) check(orders ...string) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		for _, order := range orders {
			charges := s.processor.Charges(order)
			switch len(charges) {
			case 0:
				return fmt.Errorf("%s never charged", order)
			case 1:
			case 2:
				return fmt.Errorf("%s charged twice", order)
			default:
				return fmt.Errorf("%s charged %d times", order, len(charges))
			}
			rows, err := s.pool.Query(ctx, "SELECT charge_id FROM "+s.ledger+" WHERE order_id = $1", order)
			if err != nil {
				return err
			}
			booked, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				return err
			}
			if len(booked) != 1 || booked[0] != charges[0] {
				return fmt.Errorf("%s charged %s, booked %v", order, charges[0], booked)
			}
		}
		return nil
	}
}

// chargeRight charges the card in a step, with a key derived for the
// processor: a retry of the step sends the same key (the processor returns
// the charge it made), and once the step committed a retry skips it.
func chargeRight(s *shop) consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		err := d.Step(ctx, "charge", func(ctx context.Context, tx pgx.Tx) error {
			charge := s.processor.Charge(d.DerivedKey("charge"), d.Key, 4200)
			return s.book(ctx, tx, d.Key, charge)
		})
		return consumer.Response{Code: 201}, err
	}
}

// chargeWrong calls the processor from the handler, with a fresh request
// id each time, and books the charge in the handler's transaction: a
// redelivery after the charge charges again.
func chargeWrong(s *shop) consumer.Handler {
	var mu sync.Mutex
	requests := 0
	return func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		mu.Lock()
		requests++
		request := "req-" + strconv.Itoa(requests)
		mu.Unlock()
		charge := s.processor.Charge(request, d.Key, 4200)
		return consumer.Response{Code: 201}, s.book(ctx, tx, d.Key, charge)
	}
}

// The card charge under every crash point, through a real consumer of a
// real RabbitMQ queue. Done right (a Step, and DerivedKey as the
// processor's idempotency key) it passes at every point. Done without
// them, the crash after the charge, before COMMIT, is caught: the broker
// redelivers, the redelivery takes the key over once the dead worker's
// lease expired, and charges the card again. (So is a handler slow enough
// to lose its lease: the copy that takes the key over charges again.)
func ExampleCrashPoints() {
	ctx := context.Background()
	// In a test: the test's pool, deduptest.Store(t, pool, nil) in setup,
	// and the test's t.
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
	t := &testing.T{} // in a test, the test's own

	// A prefix of its own, so that two runs on one database do not meet.
	prefix := "idemq_example_crash_" + strings.ToLower(rand.Text()[:8]) + "_"
	schemas := 0
	setup := func(handler func(*shop) consumer.Handler) func(testing.TB) consumertest.Subject {
		return func(tb testing.TB) consumertest.Subject {
			schemas++
			dbSchema := prefix + strconv.Itoa(schemas)
			pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+dbSchema+" CASCADE") //nolint:errcheck
			if err := schema.Migrate(ctx, pool, dbSchema); err != nil {
				log.Fatal(err)
			}
			s := &shop{pool: pool, ledger: dbSchema + ".ledger", processor: newCardProcessor()}
			if _, err := pool.Exec(ctx, "CREATE TABLE "+s.ledger+" (order_id text, charge_id text)"); err != nil {
				log.Fatal(err)
			}
			store, err := dedup.NewStore(pool, &dedup.Config{Schema: dbSchema})
			if err != nil {
				log.Fatal(err)
			}
			return consumertest.Subject{
				Store: store, Handler: handler(s), Check: s.check("order-1001"),
				// The consumer's configuration: the broker, and whatever the
				// production consumer sets (its mode: the default, groups).
				Config: &consumer.Config{URL: amqpURL, Steps: true},
			}
		}
	}
	defer func() {
		for i := 1; i <= schemas; i++ {
			pool.Exec(ctx, "DROP SCHEMA "+prefix+strconv.Itoa(i)+" CASCADE") //nolint:errcheck
		}
	}()
	// The publisher's trace travels with the message: the report names
	// each crashed attempt by it.
	msg := amqp.Publishing{
		MessageId: "order-1001", Body: []byte(`{"card":"4242","amount":4200}`),
		Headers: amqp.Table{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
	}

	right := consumertest.CrashPoints(t, setup(chargeRight), msg)
	fmt.Printf("Step and DerivedKey, mode %s: every point passed: %v\n", right.Mode, !right.Failed())
	fmt.Println(right)

	wrong := consumertest.CrashPoints(t, setup(chargeWrong), msg)
	// The test's assertion: the crash after the charge, before COMMIT,
	// charged twice.
	if row := wrong.Row(consumertest.PointBeforeCommit); row.Err == nil || row.Err.Error() != "order-1001 charged twice" {
		log.Fatalf("the wrong handler was not caught: %v", row.Err)
	}
	fmt.Println("\nwithout them: caught", consumertest.PointBeforeCommit+":", wrong.Row(consumertest.PointBeforeCommit).Err)
	fmt.Println(wrong)
	// Output:
	// Step and DerivedKey, mode group: every point passed: true
	// point                                   result  trace
	// no crash                                passed  -
	// after the reservation                   passed  4bf92f3577b34da6a3ce929d0e0e4736
	// in step charge, before its commit       passed  4bf92f3577b34da6a3ce929d0e0e4736
	// after step charge commits               passed  4bf92f3577b34da6a3ce929d0e0e4736
	// after the handler, before COMMIT        passed  4bf92f3577b34da6a3ce929d0e0e4736
	// after COMMIT, before the ack            passed  4bf92f3577b34da6a3ce929d0e0e4736
	// a second copy during the first          passed  4bf92f3577b34da6a3ce929d0e0e4736
	// a second copy after the first           passed  4bf92f3577b34da6a3ce929d0e0e4736
	// the lease expires under a slow handler  passed  4bf92f3577b34da6a3ce929d0e0e4736
	//
	// without them: caught after the handler, before COMMIT: order-1001 charged twice
	// point                                   result                            trace
	// no crash                                passed                            -
	// after the reservation                   passed                            4bf92f3577b34da6a3ce929d0e0e4736
	// after the handler, before COMMIT        FAILED: order-1001 charged twice  4bf92f3577b34da6a3ce929d0e0e4736
	// after COMMIT, before the ack            passed                            4bf92f3577b34da6a3ce929d0e0e4736
	// a second copy during the first          passed                            4bf92f3577b34da6a3ce929d0e0e4736
	// a second copy after the first           passed                            4bf92f3577b34da6a3ce929d0e0e4736
	// the lease expires under a slow handler  FAILED: order-1001 charged twice  4bf92f3577b34da6a3ce929d0e0e4736
}
