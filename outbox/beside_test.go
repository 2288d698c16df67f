package outbox_test

import (
	"context"
	"errors"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/outbox"
)

// What work commits just before it returns nil leaves before RunBeside
// returns: the relay drains the outbox first.
func TestRunBesideDrainsAfterWork(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 8)
	r, err := outbox.NewRelay(e.ob, testamqp.URL(), e.relayConfig(t))
	if err != nil {
		t.Fatal(err)
	}
	err = r.RunBeside(context.Background(), 20*time.Second, func(ctx context.Context) error {
		return pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
			return e.ob.Enqueue(ctx, tx, outbox.Message{Exchange: e.exchange, RoutingKey: boundKey, MessageID: "last-1", Body: []byte("x")})
		})
	})
	if err != nil {
		t.Fatalf("RunBeside: %v", err)
	}
	if b := e.backlog(t); b.Pending != 0 {
		t.Fatalf("%d rows pending after RunBeside returned, want 0", b.Pending)
	}
	if n := e.queueDepth(t); n != 1 {
		t.Fatalf("%d messages in the queue after RunBeside returned, want 1", n)
	}
}

// A relay that gives up (its credentials refused) ends work's context, and
// RunBeside returns the relay's error.
func TestRunBesideStopsWorkWhenTheRelayGivesUp(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 8)
	u, err := url.Parse(testamqp.URL())
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword("idemq-no-such-user", "wrong")
	r, err := outbox.NewRelay(e.ob, u.String(), e.relayConfig(t))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		done <- r.RunBeside(context.Background(), time.Second, func(ctx context.Context) error {
			<-ctx.Done() // work that runs until told to stop
			return nil
		})
	}()
	select {
	case err := <-done:
		var ae *amqp.Error
		if !errors.As(err, &ae) && !errors.Is(err, amqp.ErrCredentials) {
			t.Fatalf("RunBeside = %v, want the refused credentials", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("work still runs 30s after its relay gave up")
	}
}

// Work that fails stops the relay at once: RunBeside returns work's error.
func TestRunBesideReturnsWorksError(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 8)
	r, err := outbox.NewRelay(e.ob, testamqp.URL(), e.relayConfig(t))
	if err != nil {
		t.Fatal(err)
	}
	boom := errors.New("work failed")
	if err := r.RunBeside(context.Background(), time.Minute, func(context.Context) error { return boom }); !errors.Is(err, boom) {
		t.Fatalf("RunBeside = %v, want work's error", err)
	}
}
