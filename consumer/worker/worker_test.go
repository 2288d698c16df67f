package worker_test

import (
	"context"
	"errors"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/worker"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/outbox"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// run starts w.Run until the test ends. stop ends its context and returns
// its error; done gives its error when it returns by itself.
func run(t *testing.T, w *worker.Worker) (stop func() error, done func(time.Duration) (error, bool)) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- w.Run(ctx) }()
	var (
		returned bool
		err      error
	)
	done = func(timeout time.Duration) (error, bool) {
		if !returned {
			select {
			case err = <-errc:
				returned = true
			case <-time.After(timeout):
			}
		}
		return err, returned
	}
	stop = func() error {
		cancel()
		if err, ok := done(30 * time.Second); ok {
			return err
		}
		t.Fatal("Run did not return within 30s of its context ending")
		return nil
	}
	t.Cleanup(func() { _ = stop() })
	return stop, done
}

// A handler's outbox message leaves through the worker's own relay; when the
// context ends, Run drains and returns nil.
func TestRunRelaysWhatHandlersEnqueue(t *testing.T) {
	t.Parallel()
	e := testenv.New(t)
	cfg, events := e.ConsumerConfig("it.worker.orders", "orders")
	target := testamqp.Name(t, "it.worker.receipts")
	ch := e.Pub
	if _, err := ch.QueueDeclare(target, false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	w, err := worker.New(e.Store, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		return consumer.Response{}, outbox.Enqueue(ctx, tx, outbox.Message{RoutingKey: target, Body: d.Body, MessageID: "receipt-" + d.Key})
	}, &worker.Config{Consumer: cfg, Relay: outbox.RelayConfig{PollInterval: 100 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	stop, _ := run(t, w)
	e.Publish(cfg.Queue, "order-1", `{"order":1}`, nil)
	testenv.WaitOutcome(t, events, consumer.OutcomeProcessed)
	if err := stop(); err != nil {
		t.Fatalf("Run after its context ended: %v, want nil", err)
	}
	// Drained before Run returned: the receipt is in its queue now.
	msg, ok, err := ch.Get(target, true)
	if err != nil || !ok || msg.MessageId != "receipt-order-1" {
		t.Fatalf("receipt queue after Run returned: ok %v, message id %q, err %v; want receipt-order-1", ok, msg.MessageId, err)
	}
	b, err := w.Outbox().Pending(context.Background())
	if err != nil || b.Pending != 0 {
		t.Fatalf("outbox after Run returned: %d pending (err %v), want 0", b.Pending, err)
	}
}

// A relay that fails for good (the broker refuses its credentials) stops the
// consumer, and Run returns the relay's error without its context ending.
func TestRelayFailureStopsTheWorker(t *testing.T) {
	t.Parallel()
	e := testenv.New(t)
	cfg, _ := e.ConsumerConfig("it.worker.relayfail", "relayfail")
	refused := func(context.Context) (*amqp.Connection, error) {
		return amqp.Dial(wrongUserURL(t))
	}
	w, err := worker.New(e.Store, func(context.Context, pgx.Tx, *consumer.Delivery) (consumer.Response, error) {
		return consumer.Response{}, nil
	}, &worker.Config{Consumer: cfg, Relay: outbox.RelayConfig{Dial: refused}})
	if err != nil {
		t.Fatal(err)
	}
	_, done := run(t, w)
	err, ok := done(30 * time.Second)
	if !ok {
		t.Fatal("Run still runs 30s after its relay failed")
	}
	if err == nil || !errors.Is(err, amqp.ErrCredentials) && !isAccessRefused(err) {
		t.Fatalf("Run = %v, want the relay's refused credentials", err)
	}
}

// A consumer that fails for good stops the relay, and Run returns its error.
func TestConsumerFailureStopsTheWorker(t *testing.T) {
	t.Parallel()
	e := testenv.New(t)
	cfg, _ := e.ConsumerConfig("it.worker.consumerfail", "consumerfail")
	cfg.URL = wrongUserURL(t)
	w, err := worker.New(e.Store, func(context.Context, pgx.Tx, *consumer.Delivery) (consumer.Response, error) {
		return consumer.Response{}, nil
	}, &worker.Config{Consumer: cfg, Relay: outbox.RelayConfig{Dial: func(ctx context.Context) (*amqp.Connection, error) {
		return amqp.Dial(testamqp.URL())
	}}})
	if err != nil {
		t.Fatal(err)
	}
	_, done := run(t, w)
	err, ok := done(30 * time.Second)
	if !ok {
		t.Fatal("Run still runs 30s after its consumer failed")
	}
	if err == nil {
		t.Fatal("Run = nil, want the consumer's refused credentials")
	}
}

// GC in the worker retires completed keys past their retention.
func TestRunsRetention(t *testing.T) {
	t.Parallel()
	e := testenv.New(t)
	cfg, events := e.ConsumerConfig("it.worker.gc", "gc")
	w, err := worker.New(e.Store, func(context.Context, pgx.Tx, *consumer.Delivery) (consumer.Response, error) {
		return consumer.Response{}, nil
	}, &worker.Config{Consumer: cfg, NoRelay: true, GC: &worker.GC{Every: 100 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	e.Publish(cfg.Queue, "old-1", `{}`, nil)
	stop, _ := run(t, w)
	testenv.WaitOutcome(t, events, consumer.OutcomeProcessed)
	// Age the key past the default retention.
	if _, err := e.Pool.Exec(context.Background(),
		`UPDATE `+pgx.Identifier{e.Schema, "keys"}.Sanitize()+` SET completed_at = now() - interval '48 hours', created_at = now() - interval '48 hours'`); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		var n int
		if err := e.Pool.QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{e.Schema, "keys"}.Sanitize()).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d keys left 20s after they passed their retention", n)
		}
		select {
		case <-time.After(100 * time.Millisecond):
		case <-t.Context().Done():
			t.Fatal(t.Context().Err())
		}
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// New refuses a retention without an interval.
func TestNewRefusesGCWithoutInterval(t *testing.T) {
	t.Parallel()
	e := testenv.New(t)
	cfg, _ := e.ConsumerConfig("it.worker.badgc", "badgc")
	if _, err := worker.New(e.Store, func(context.Context, pgx.Tx, *consumer.Delivery) (consumer.Response, error) {
		return consumer.Response{}, nil
	}, &worker.Config{Consumer: cfg, GC: &worker.GC{}}); err == nil {
		t.Fatal("New accepted GC.Every 0")
	}
}

// wrongUserURL is the test broker's URL with credentials it refuses.
func wrongUserURL(t *testing.T) string {
	u, err := url.Parse(testamqp.URL())
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword("idemq-no-such-user", "wrong")
	return u.String()
}

func isAccessRefused(err error) bool {
	var ae *amqp.Error
	return errors.As(err, &ae) && ae.Code == amqp.AccessRefused
}
