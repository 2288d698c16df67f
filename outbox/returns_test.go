package outbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/outbox"
)

// Two rows of one relay batch share a message_id (a fan-out by routing
// key); one is unroutable. The routable one is marked published and
// arrives once; the unroutable one stays in the outbox (retried, then
// parked), never marked published. (The relay used to book returns by
// message_id: it marked the unroutable row published and kept the other.)
func TestRelayReturnsAreBookedPerPublishNotPerMessageID(t *testing.T) {
	e := newEnv(t, 8)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		if err := e.ob.Enqueue(ctx, tx, outbox.Message{Exchange: e.exchange, RoutingKey: "nowhere", MessageID: "shared", Body: []byte("to nowhere")}); err != nil {
			return err
		}
		return e.ob.Enqueue(ctx, tx, outbox.Message{Exchange: e.exchange, RoutingKey: boundKey, MessageID: "shared", Body: []byte("to the queue")})
	})
	if err != nil {
		t.Fatal(err)
	}
	cfg := e.relayConfig(t)
	cfg.MaxReturns = 2
	e.startRelay(t, cfg)
	ids, got := e.consumeAll(t, 1, 30*time.Second)
	if ids["shared"] != 1 || string(got[0].Body) != "to the queue" {
		t.Fatalf("received %v (%q), want the routable row once", ids, got[0].Body)
	}
	waitFor(t, 30*time.Second, "the unroutable row parked", func() bool { return e.backlog(t).Parked == 1 })
	var routing string
	var published bool
	err = e.pool.QueryRow(ctx, "SELECT routing_key, published_at IS NOT NULL FROM "+e.schema+".outbox WHERE parked_at IS NOT NULL").Scan(&routing, &published)
	if err != nil {
		t.Fatal(err)
	}
	if routing != "nowhere" || published {
		t.Fatalf("parked row routing key %q published %v, want the unroutable row, not published", routing, published)
	}
	if n := e.queueDepth(t); n != 0 {
		t.Fatalf("the queue got %d more copies of the routable row", n)
	}
}

// A row whose headers cannot fit in one frame is parked with the reason,
// never sent (the broker would close the relay's connection over it, on
// every attempt); the rows after it are published.
func TestRelayParksARowTooLargeForAFrame(t *testing.T) {
	e := newEnv(t, 8)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		big := outbox.Message{Exchange: e.exchange, RoutingKey: boundKey, MessageID: "big",
			Headers: amqp.Table{"pad": strings.Repeat("p", 200_000)}}
		if err := e.ob.Enqueue(ctx, tx, big); err != nil {
			return err
		}
		return e.ob.Enqueue(ctx, tx, outbox.Message{Exchange: e.exchange, RoutingKey: boundKey, MessageID: "after"})
	})
	if err != nil {
		t.Fatal(err)
	}
	e.startRelay(t, e.relayConfig(t))
	ids, _ := e.consumeAll(t, 1, 30*time.Second)
	if ids["after"] != 1 {
		t.Fatalf("received %v, want the row after the big one", ids)
	}
	waitFor(t, 30*time.Second, "the big row parked", func() bool { return e.backlog(t).Parked == 1 })
	var reason string
	if err := e.pool.QueryRow(ctx, "SELECT parked_reason FROM "+e.schema+".outbox WHERE message_id = 'big'").Scan(&reason); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(reason, "frame_max") {
		t.Errorf("parked reason %q does not say frame_max", reason)
	}
}
