package interop_test

import (
	"context"
	"maps"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testenv"
)

// CloudEvents published by the cloudevents npm package through amqplib, in
// binary mode (the HTTP binding's ce- headers and the AMQP binding's
// cloudEvents_) and in structured mode, are keyed by source and id: an
// event resent with a new message_id, or in the other mode, is a duplicate;
// the same id from another source is another event.
func TestNodeCloudEventsPublisher(t *testing.T) {
	t.Parallel()
	modules := installNode(t)
	e := testenv.New(t)
	if _, err := e.Pool.Exec(t.Context(), "CREATE TABLE "+e.Schema+".effects (key text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	cfg, events := e.ConsumerConfig("node-ce", "events")
	cfg.KeyFrom = consumer.KeyFromCloudEvents
	cfg.Concurrency = 1
	e.Run(cfg, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		_, err := tx.Exec(ctx, "INSERT INTO "+e.Schema+".effects (key) VALUES ($1)", d.Key)
		return consumer.Response{Code: 200}, err
	})

	node(t, modules, cfg.Queue, "publish")
	outcomes := map[consumer.Outcome]int{}
	deadline := time.After(30 * time.Second)
	for n := 0; n < 6; {
		select {
		case ev := <-events:
			outcomes[ev.Outcome]++
			n++
		case <-deadline:
			t.Fatalf("6 outcomes not in within 30s: %v", outcomes)
		}
	}
	if want := map[consumer.Outcome]int{consumer.OutcomeProcessed: 3, consumer.OutcomeDuplicate: 3}; !maps.Equal(outcomes, want) {
		t.Errorf("outcomes %v, want %v", outcomes, want)
	}
	rows, err := e.Pool.Query(t.Context(), "SELECT key, count(*) FROM "+e.Schema+".effects GROUP BY key")
	if err != nil {
		t.Fatal(err)
	}
	effects, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (struct {
		key string
		n   int
	}, error) {
		var v struct {
			key string
			n   int
		}
		return v, r.Scan(&v.key, &v.n)
	})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int{}
	for _, v := range effects {
		got[v.key] = v.n
	}
	if want := map[string]int{"/node/orders order-1": 1, "/node/orders order-2": 1, "/node/billing order-1": 1}; !maps.Equal(got, want) {
		t.Errorf("effects %v, want %v", got, want)
	}
}
