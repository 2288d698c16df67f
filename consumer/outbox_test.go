package consumer_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
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
		claim := outbox.Claim{Consumer: "payments", Key: "order-77"}
		want := []string{outbox.MessageID(claim, 1), outbox.MessageID(claim, 2)}
		if fmt.Sprint(ids) != fmt.Sprint(want) {
			t.Fatalf("outbox message ids %v, want %v (only the committed attempt's, derived from the key)", ids, want)
		}
	})
}
