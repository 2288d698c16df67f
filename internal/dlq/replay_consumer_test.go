package dlq_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/dlq"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

// TestReplayedDeadLetterKeepsItsTenant: a consumer that takes the tenant
// from user_id dead-letters alice's message (permanent error); Replay, which
// holds no header key, moves it back. The replayed copy still verifies: the
// consumer handles it as alice's (same key scope), as a first attempt, once.
func TestReplayedDeadLetterKeepsItsTenant(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, 8)
	schema := testdb.Schema(t, pool)
	if err := dedup.Migrate(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	events := make(chan consumer.Event, 16)
	queue := testamqp.Name(t, "dlqreplay")
	cfg := consumer.Config{
		URL: testamqp.URL(), Queue: queue, Name: "payments", TenantFromUserID: true,
		RetryInitial: 200 * time.Millisecond, MaxAttempts: 3, ShutdownTimeout: 10 * time.Second,
		ConnectionName: "idemq-test-" + queue,
		OnOutcome:      func(ev consumer.Event) { events <- ev },
	}
	topo := consumer.NewTopology(&cfg)
	queues := []string{topo.Queue, topo.DLQ}
	for _, d := range topo.Delays {
		queues = append(queues, topo.TierName(d))
	}
	testamqp.DeleteQueuesAtCleanup(t, queues, []string{topo.DLX})
	if err := consumer.Apply(&cfg); err != nil {
		t.Fatal(err)
	}

	var mu sync.Mutex
	var seen []string
	c, err := consumer.New(store, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, fmt.Sprintf("%s/%d", d.Tenant, d.Attempt))
		if len(seen) == 1 {
			return consumer.Response{}, consumer.Permanent(errors.New("not yet"))
		}
		return consumer.Response{}, nil
	}, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	t.Cleanup(func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	})
	next := func(what string) consumer.Event {
		t.Helper()
		select {
		case ev := <-events:
			return ev
		case <-time.After(30 * time.Second):
			t.Fatalf("no %s within 30s", what)
			return consumer.Event{}
		}
	}

	alice, aliceURL := testamqp.AddUser(t, "alice")
	aliceCh := testamqp.Channel(t, testamqp.DialURL(t, aliceURL))
	testamqp.Publish(t, aliceCh, "", queue, amqp.Publishing{MessageId: "replayed-op", UserId: alice, Body: []byte(`{}`)})
	if ev := next("dead letter"); ev.Outcome != consumer.OutcomeDeadLettered {
		t.Fatalf("first delivery: %s, want dead_lettered", ev.Outcome)
	}
	waitReady(t, testamqp.Dial(t), dlq.Name(queue), 1)

	res, err := dlq.Replay(ctx, testamqp.Dial(t), dlq.ReplayOptions{Queue: dlq.Name(queue), Target: queue})
	if err != nil || res.Replayed != 1 {
		t.Fatalf("replay: %+v, %v", res, err)
	}
	if ev := next("replayed copy"); ev.Outcome != consumer.OutcomeProcessed || ev.Tenant != alice || ev.Attempt != 1 {
		t.Fatalf("replayed copy: %s under tenant %q at attempt %d, want processed under %q at 1", ev.Outcome, ev.Tenant, ev.Attempt, alice)
	}
	mu.Lock()
	defer mu.Unlock()
	if want := []string{alice + "/1", alice + "/1"}; fmt.Sprint(seen) != fmt.Sprint(want) {
		t.Fatalf("the handler saw tenant/attempt %v, want %v", seen, want)
	}
	if rec, err := store.Inspect(ctx, "payments", alice, "replayed-op"); err != nil || rec.State != dedup.StateCompleted {
		t.Fatalf("alice's key: %+v, %v; want completed", rec, err)
	}
}
