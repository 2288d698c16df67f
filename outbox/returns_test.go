package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

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
