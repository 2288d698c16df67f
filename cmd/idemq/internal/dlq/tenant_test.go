package dlq_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/cmd/idemq/internal/dlq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testenv"
)

// TestReplayedDeadLetterKeepsItsTenant dead-letters a message published as a
// second broker user to a consumer that takes the tenant from user_id, then
// replays it: the copy carries no user_id (the worker's connection could not
// publish it), yet it is handled under the first publisher's tenant.
func TestReplayedDeadLetterKeepsItsTenant(t *testing.T) {
	e := testenv.New(t)
	cfg, events := e.ConsumerConfig("dlq.tenant", "tenant-replay")
	cfg.TenantFromUserID = true
	alice, aliceURL := testamqp.AddUser(t, "alice")
	aliceCh := testamqp.Channel(t, testamqp.DialURL(t, aliceURL))

	var mu sync.Mutex
	var seen []string
	e.Run(cfg, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		mu.Lock()
		seen = append(seen, d.Tenant)
		first := len(seen) == 1
		mu.Unlock()
		if first {
			return consumer.Response{}, consumer.Permanent(errors.New("not yet"))
		}
		return consumer.Response{}, nil
	})
	testamqp.Publish(t, aliceCh, "", cfg.Queue, amqp.Publishing{MessageId: "replayed-op", UserId: alice, Body: []byte(`{}`)})
	testenv.WaitOutcome(t, events, consumer.OutcomeDeadLettered)

	res, err := dlq.Replay(context.Background(), testamqp.Dial(t), dlq.ReplayOptions{Queue: dlq.Name(cfg.Queue), Target: cfg.Queue})
	if err != nil || res.Replayed != 1 {
		t.Fatalf("replay: %+v, %v", res, err)
	}
	ev := testenv.WaitOutcome(t, events, consumer.OutcomeProcessed)
	if ev.Tenant != alice {
		t.Fatalf("replayed copy handled under tenant %q, want %q", ev.Tenant, alice)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != 2 || seen[0] != alice || seen[1] != alice {
		t.Fatalf("the handler saw tenants %q, want %q twice", seen, alice)
	}
}
