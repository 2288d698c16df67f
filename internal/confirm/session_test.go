package confirm_test

import (
	"context"
	"errors"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/confirm"
	"github.com/idemq/idemq/internal/testamqp"
)

func openSession(t *testing.T, ttl time.Duration) *confirm.Session {
	t.Helper()
	s, err := confirm.Open(testamqp.Dial(t), ttl)
	if err != nil {
		t.Fatalf("open session: %v", err)
	}
	t.Cleanup(s.Close)
	return s
}

// A missing exchange is found by the probe, not by a publish: the session
// stays alive and publishes on it still confirm. Once the exchange exists it
// is found, and kept without asking again.
func TestSessionChecksExchangesWithoutLosingItsChannel(t *testing.T) {
	s := openSession(t, 0)
	exchange := testamqp.Name(t, "session-x")
	queue := testamqp.Name(t, "session-q")

	err := s.CheckExchange(exchange)
	var ret *confirm.ReturnError
	if !errors.As(err, &ret) || ret.Code != amqp.NotFound || !errors.Is(err, confirm.ErrUnroutable) {
		t.Fatalf("missing exchange: got %v, want a 404 ReturnError", err)
	}
	if !s.Alive() {
		t.Fatal("the session died of a probe")
	}
	if s.ExchangeKnown(exchange) {
		t.Fatal("a missing exchange is known")
	}

	ch := testamqp.Channel(t, testamqp.Dial(t))
	testamqp.Sink(t, ch, exchange, amqp.ExchangeDirect, queue, "k")
	testamqp.DeleteQueuesAtCleanup(t, []string{queue}, []string{exchange})
	if err := s.CheckExchange(exchange); err != nil {
		t.Fatalf("the exchange, declared: %v", err)
	}
	if !s.ExchangeKnown(exchange) || !s.ExchangeKnown("") {
		t.Fatal("an exchange found (or the default one) is not known")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.Publisher().PublishWait(ctx, exchange, "k", amqp.Publishing{Body: []byte("x")}); err != nil {
		t.Fatalf("publish after the probes: %v", err)
	}
}

// An exchange found is trusted for the TTL only.
func TestSessionExchangeTTL(t *testing.T) {
	s := openSession(t, 50*time.Millisecond)
	exchange := testamqp.Name(t, "session-ttl")
	ch := testamqp.Channel(t, testamqp.Dial(t))
	if err := ch.ExchangeDeclare(exchange, amqp.ExchangeDirect, false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := s.CheckExchange(exchange); err != nil {
		t.Fatal(err)
	}
	if !s.ExchangeKnown(exchange) {
		t.Fatal("not known right after it was found")
	}
	deadline := time.Now().Add(5 * time.Second)
	for s.ExchangeKnown(exchange) {
		if time.Now().After(deadline) {
			t.Fatal("still known long after its TTL")
		}
		time.Sleep(10 * time.Millisecond) // waiting for a clock, not an event
	}
	if err := ch.ExchangeDelete(exchange, false, false); err != nil {
		t.Fatal(err)
	}
	if err := s.CheckExchange(exchange); !errors.Is(err, confirm.ErrUnroutable) {
		t.Fatalf("deleted after its TTL: got %v, want ErrUnroutable", err)
	}
}

// A session the broker closes is dead with the broker's reason; Close
// after it (and twice) returns.
func TestSessionDiesWithTheBrokersReason(t *testing.T) {
	s := openSession(t, 0)
	// A publish to a missing exchange makes the broker close the channel.
	_, _ = s.Publisher().Publish(context.Background(), testamqp.Name(t, "nowhere"), "k", amqp.Publishing{Body: []byte("x")})
	select {
	case <-s.Dead():
	case <-time.After(10 * time.Second):
		t.Fatal("the session did not die")
	}
	if s.Alive() {
		t.Fatal("a dead session is alive")
	}
	var ae *amqp.Error
	if !errors.As(s.Err(), &ae) || ae.Code != amqp.NotFound {
		t.Fatalf("Err: got %v, want the broker's 404", s.Err())
	}
	s.Close()
	s.Close()
}
