package outbox_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/outbox"
)

func TestRowsPendingAndParked(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		for _, id := range []string{"m-1", "m-2", "m-3"} {
			if err := e.ob.Enqueue(ctx, tx, outbox.Message{Exchange: e.exchange, RoutingKey: "r", MessageID: id, Body: []byte("body")}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(ctx, `UPDATE `+e.schema+`.outbox SET parked_at = now(), parked_reason = 'unroutable: 312 NO_ROUTE', returns = 3
WHERE message_id = 'm-2'`); err != nil {
		t.Fatal(err)
	}
	pending, err := e.ob.Rows(ctx, false, 0)
	if err != nil || len(pending) != 2 || pending[0].MessageID != "m-1" || pending[1].MessageID != "m-3" {
		t.Fatalf("pending: %+v, %v", pending, err)
	}
	if p := pending[0]; p.Exchange != e.exchange || p.RoutingKey != "r" || p.BodySize != 4 || p.ParkedAt != nil || p.CreatedAt.IsZero() {
		t.Fatalf("pending row: %+v", p)
	}
	parked, err := e.ob.Rows(ctx, true, 0)
	if err != nil || len(parked) != 1 || parked[0].ParkedAt == nil || parked[0].ParkedReason != "unroutable: 312 NO_ROUTE" || parked[0].Returns != 3 {
		t.Fatalf("parked: %+v, %v", parked, err)
	}
	if one, err := e.ob.Rows(ctx, false, 1); err != nil || len(one) != 1 {
		t.Fatalf("limit 1: %+v, %v", one, err)
	}
}
