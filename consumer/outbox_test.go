package consumer_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/outbox"
)

func TestOutboxRowsCommitWithTheKeyAndKeepTheirIDs(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, nil)
		h.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			for i := range 2 {
				if err := outbox.Enqueue(ctx, tx, outbox.Message{Exchange: "receipts", Body: fmt.Appendf(nil, "receipt %d of %s", i, d.Key)}); err != nil {
					return consumer.Response{}, err
				}
			}
			if d.Attempt == 1 {
				return consumer.Response{}, errInfra // rolls back the two rows and the key
			}
			return h.ledgerEffect(ctx, tx, d)
		})
		h.publish("order-77", `{}`, nil)
		h.waitEvents(30*time.Second, "processing on the second attempt", func(evs []consumer.Event) bool {
			return countOutcomes(evs)[consumer.OutcomeProcessed] == 1
		})
		rows, err := h.pool.Query(context.Background(), "SELECT message_id FROM "+h.schema+".outbox ORDER BY id")
		if err != nil {
			t.Fatal(err)
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		scope := dedup.Scope{Consumer: "payments", Key: "order-77"}
		want := []string{outbox.MessageID(scope, "", 1), outbox.MessageID(scope, "", 2)}
		if fmt.Sprint(ids) != fmt.Sprint(want) {
			t.Fatalf("outbox message ids %v, want %v (only the committed attempt's, derived from the key)", ids, want)
		}
	})
}

// In a group, the outbox rows a handler enqueued go with its outcome: those
// of a handler that failed after enqueueing are never written, those of its
// group-mates commit, one per message. A row enqueued on a transaction of
// the handler's own is written at once, as always.
func TestOutboxRowsOfAFailedHandlerAreDropped(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, func(c *consumer.Config) { c.Concurrency, c.Group.Linger = 1, 200*time.Millisecond })
		const n = 12
		failing := map[string]bool{keyOf(3, "ob"): true, keyOf(7, "ob"): true}
		own := keyOf(5, "ob")
		for i := range n {
			h.publish(keyOf(i, "ob"), `{}`, nil)
		}
		h.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			if d.Key == own {
				// A transaction of the handler's own: written at once, and
				// committed whatever the handler's outcome.
				if err := pgx.BeginFunc(ctx, h.pool, func(own pgx.Tx) error {
					return outbox.Enqueue(ctx, own, outbox.Message{Exchange: "audit", MessageID: "audit-" + d.Key, Body: []byte("seen")})
				}); err != nil {
					return consumer.Response{}, err
				}
			}
			if err := outbox.Enqueue(ctx, tx, outbox.Message{Exchange: "receipts", Body: []byte("receipt of " + d.Key)}); err != nil {
				return consumer.Response{}, err
			}
			if failing[d.Key] {
				return consumer.Response{}, consumer.Permanent(fmt.Errorf("refused after enqueueing"))
			}
			return h.ledgerEffect(ctx, tx, d)
		})
		h.waitEvents(30*time.Second, "every message's outcome", func(evs []consumer.Event) bool { return finals(evs) >= n })
		rows, err := h.pool.Query(context.Background(), "SELECT convert_from(body, 'UTF8') FROM "+h.schema+".outbox WHERE exchange = 'receipts'")
		if err != nil {
			t.Fatal(err)
		}
		bodies, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]int{}
		for _, b := range bodies {
			got[b]++
		}
		for i := range n {
			key, want := keyOf(i, "ob"), 1
			if failing[key] {
				want = 0
			}
			if got["receipt of "+key] != want {
				t.Errorf("%s: %d receipts in the outbox, want %d", key, got["receipt of "+key], want)
			}
		}
		var audits int
		if err := h.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+h.schema+".outbox WHERE exchange = 'audit'").Scan(&audits); err != nil {
			t.Fatal(err)
		}
		if audits != 1 {
			t.Errorf("%d audit rows from the handler's own transaction, want 1", audits)
		}
	})
}
