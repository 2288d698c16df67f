package consumer_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/wire"
)

func TestConcurrentCopiesHaveOneEffect(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		const rounds, copies = 20, 20
		h := newHarness(t, m, func(c *consumer.Config) { c.RetryInitial = 100 * time.Millisecond })
		var calls atomic.Int64
		h.start(4, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			calls.Add(1)
			return h.ledgerEffect(ctx, tx, d)
		})
		for r := range rounds {
			key := keyOf(r, "burst")
			var wg sync.WaitGroup
			for range copies {
				wg.Go(func() { h.publish(key, `{"amount":100}`, nil) })
			}
			wg.Wait()
		}
		evs := h.waitEvents(60*time.Second, "every copy to settle", func(evs []consumer.Event) bool { return finals(evs) >= rounds*copies })
		counts := countOutcomes(evs)
		if counts[consumer.OutcomeProcessed] != rounds || counts[consumer.OutcomeDuplicate] != rounds*(copies-1) {
			t.Fatalf("outcomes %v, want %d processed and %d duplicates", counts, rounds, rounds*(copies-1))
		}
		eff := h.effects()
		for r := range rounds {
			if n := eff[keyOf(r, "burst")]; n != 1 {
				t.Fatalf("key %s has %d effects, want 1", keyOf(r, "burst"), n)
			}
		}
		if calls.Load() != rounds {
			t.Fatalf("handler ran %d times, want %d", calls.Load(), rounds)
		}
	})
}

func TestEveryOutcome(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, nil)
		var calls sync.Map // key → *atomic.Int64
		h.start(2, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			n, _ := calls.LoadOrStore(d.Key, new(atomic.Int64))
			n.(*atomic.Int64).Add(1)
			if _, err := h.ledgerEffect(ctx, tx, d); err != nil {
				return consumer.Response{}, err
			}
			switch {
			case strings.HasPrefix(d.Key, "reject"):
				return consumer.Response{}, consumer.Reject(402, "insufficient funds", []byte(`{"error":"insufficient_funds"}`))
			case strings.HasPrefix(d.Key, "permanent"):
				return consumer.Response{}, consumer.Permanent(errors.New("amount is not a number"))
			case strings.HasPrefix(d.Key, "infra"):
				return consumer.Response{}, errInfra
			case strings.HasPrefix(d.Key, "panic"):
				panic("nil map in card network client")
			}
			return h.ledgerEffect(ctx, tx, d)
		})
		h.publish("ok-1", `{"amount":1}`, nil)
		h.publish("reject-1", `{"amount":2}`, nil)
		h.publish("permanent-1", `{"amount":"x"}`, nil)
		h.publish("infra-1", `{"amount":3}`, nil)
		h.publish("panic-1", `{"amount":4}`, nil)
		h.publish("", `{"amount":5}`, nil)                                                     // no key at all
		h.publish("", `{"amount":6}`, amqp.Table{"Idempotency-Key": "bad\nkey"})               // control character
		h.publish("", `{"amount":7}`, amqp.Table{"Idempotency-Key": strings.Repeat("k", 256)}) // too long
		h.waitEvents(30*time.Second, "first round", func(evs []consumer.Event) bool {
			c := countOutcomes(evs)
			return c[consumer.OutcomeProcessed] == 1 && c[consumer.OutcomeRejected] == 1
		})
		// Duplicates of the processed and the rejected key, and a reused key.
		h.publish("ok-1", `{"amount":1}`, nil)
		h.publish("reject-1", `{"amount":2}`, nil)
		h.publish("ok-1", `{"amount":999}`, nil)

		// ok, reject, 2 duplicates; permanent, infra (max attempts), panic (max attempts),
		// missing key, invalid key ×2, key reuse: 7 dead letters.
		evs := h.waitEvents(60*time.Second, "all outcomes", func(evs []consumer.Event) bool { return finals(evs) >= 11 })
		counts := countOutcomes(evs)
		want := map[consumer.Outcome]int{
			consumer.OutcomeProcessed: 1, consumer.OutcomeRejected: 1, consumer.OutcomeDuplicate: 2,
			consumer.OutcomeDeadLettered: 3, consumer.OutcomeInvalidKey: 3, consumer.OutcomeKeyReuse: 1,
			consumer.OutcomeRetried: 4, // infra and panic: attempts 1 and 2 retried, 3 dead-lettered
		}
		for o, n := range want {
			if counts[o] != n {
				t.Errorf("outcome %s: %d, want %d (all: %v)", o, counts[o], n, counts)
			}
		}
		// The panic's failures carry its value and the stack, down to the handler.
		panics := 0
		for _, ev := range evs {
			if pe := (*consumer.PanicError)(nil); errors.As(ev.Err, &pe) {
				panics++
				if pe.Value != "nil map in card network client" || !bytes.Contains(pe.Stack, []byte("consumer_test.go")) {
					t.Errorf("panic error: value %v, stack:\n%s", pe.Value, pe.Stack)
				}
			}
		}
		if panics == 0 {
			t.Error("no event carries the handler's *PanicError")
		}
		// Effects: only committed outcomes (ok and the rejection's own rows) remain.
		eff := h.effects()
		if eff["ok-1"] != 2 || eff["reject-1"] != 1 || eff["permanent-1"] != 0 || eff["infra-1"] != 0 || eff["panic-1"] != 0 {
			t.Fatalf("effects %v", eff)
		}
		for _, k := range []string{"ok-1", "reject-1"} {
			if m.Optimistic() || m.Batch() {
				break // a group's handlers may run again after a batch-mate failed
			}
			n, _ := calls.Load(k)
			if got := n.(*atomic.Int64).Load(); got != 1 {
				t.Fatalf("handler ran %d times for %s, want 1 (a duplicate reached it)", got, k)
			}
		}
		n, _ := calls.Load("infra-1")
		if got := n.(*atomic.Int64).Load(); got != 3 && !(got > 3 && (m.Optimistic() || m.Batch())) {
			t.Fatalf("infra handler ran %d times, want MaxAttempts=3", got)
		}
		rec, err := h.store.Inspect(context.Background(), dedup.Scope{Consumer: "payments", Key: "reject-1"})
		if err != nil || rec.Result.Outcome != dedup.OutcomeRejected || rec.Result.Code != 402 {
			t.Fatalf("stored rejection %+v %v", rec, err)
		}

		dlq := h.waitDLQ(7, 10*time.Second)
		reasons := map[string]int{}
		for _, d := range dlq {
			// Read as idemq dlq list reads it.
			l := wire.ReadLetter(&d)
			r := l.Reason
			reasons[r]++
			if l.ByBroker || l.Error == "" || l.FirstSeen == "" || l.Attempts == 0 {
				t.Errorf("dead letter %s lacks headers: %v", r, d.Headers)
			}
			if l.OriginalRoutingKey != h.cfg.Queue {
				t.Errorf("dead letter %s: original routing key %q", r, l.OriginalRoutingKey)
			}
			if r == consumer.ReasonMaxAttemptsExceeded && l.Attempts != 3 {
				t.Errorf("max attempts dead letter: attempts %d", l.Attempts)
			}
			if r == consumer.ReasonPermanentError && (d.MessageId != "permanent-1" || string(d.Body) != `{"amount":"x"}`) {
				t.Errorf("permanent dead letter lost its message id or body: %q %q", d.MessageId, d.Body)
			}
		}
		wantReasons := map[string]int{
			consumer.ReasonPermanentError: 1, consumer.ReasonMaxAttemptsExceeded: 2, consumer.ReasonKeyRequired: 1,
			consumer.ReasonKeyInvalid: 2, consumer.ReasonKeyReuse: 1,
		}
		if fmt.Sprint(reasons) != fmt.Sprint(wantReasons) {
			t.Fatalf("DLQ reasons %v, want %v", reasons, wantReasons)
		}
		// No key left in progress with a valid lease, and released keys kept their attempts.
		rec, err = h.store.Inspect(context.Background(), dedup.Scope{Consumer: "payments", Key: "infra-1"})
		if err != nil || rec.State != dedup.StateInProgress || rec.LeaseValid || rec.Attempts != 3 {
			t.Fatalf("infra key after max attempts: %+v %v", rec, err)
		}
	})
}

func TestInfraFailureTwiceThenSuccess(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, func(c *consumer.Config) {
			c.RetryInitial, c.RetryMultiplier, c.MaxAttempts = 300*time.Millisecond, 2, 5
		})
		var mu sync.Mutex
		var seen []time.Time
		h.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			mu.Lock()
			seen = append(seen, time.Now())
			n := len(seen)
			mu.Unlock()
			if d.Attempt != n {
				return consumer.Response{}, consumer.Permanent(fmt.Errorf("attempt %d on call %d", d.Attempt, n))
			}
			if n <= 2 {
				return consumer.Response{}, errInfra
			}
			return h.ledgerEffect(ctx, tx, d)
		})
		h.publish("flaky-1", `{}`, nil)
		evs := h.waitEvents(30*time.Second, "processing", func(evs []consumer.Event) bool { return finals(evs) >= 1 })
		if c := countOutcomes(evs); c[consumer.OutcomeRetried] != 2 || c[consumer.OutcomeProcessed] != 1 {
			t.Fatalf("outcomes %v", c)
		}
		if eff := h.effects(); eff["flaky-1"] != 1 {
			t.Fatalf("effects %v", eff)
		}
		rec, err := h.store.Inspect(context.Background(), dedup.Scope{Consumer: "payments", Key: "flaky-1"})
		if err != nil || rec.Attempts != 3 || rec.State != dedup.StateCompleted {
			t.Fatalf("key %+v %v, want completed after 3 attempts", rec, err)
		}
		// The delays of the tiers: 300ms, then 600ms.
		mu.Lock()
		defer mu.Unlock()
		if d1, d2 := seen[1].Sub(seen[0]), seen[2].Sub(seen[1]); d1 < 300*time.Millisecond || d2 < 600*time.Millisecond {
			t.Fatalf("retry delays %s, %s; want at least 300ms, 600ms", d1, d2)
		}
	})
}

func TestSlowHandlerWithoutHeartbeatCannotCommit(t *testing.T) {
	// Leases others can see (a held key has none: its copies wait for the
	// holder's commit, see the crash kit's "a second copy during the first").
	forModes(t, mode.Separate, func(t *testing.T, m mode) {
		h := newHarness(t, m, func(c *consumer.Config) {
			c.Lease, c.Testing.DisableHeartbeat, c.Concurrency = time.Second, true, 2
			c.RetryInitial = 100 * time.Millisecond
		})
		var calls atomic.Int64
		secondDone := make(chan struct{})
		h.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			if calls.Add(1) == 1 {
				// The slow owner: outlives its lease, and the copy is taken over meanwhile.
				select {
				case <-secondDone:
				case <-time.After(20 * time.Second):
					return consumer.Response{}, errors.New("second copy never processed")
				}
				if _, err := tx.Exec(ctx, "INSERT INTO "+h.schema+".ledger (key, attempt) VALUES ($1, -1)", d.Key); err != nil {
					return consumer.Response{}, err
				}
				return consumer.Response{}, nil
			}
			return h.ledgerEffect(ctx, tx, d)
		})
		h.publish("slow-1", `{}`, nil)
		consumertest.WaitFor(t, 10*time.Second, "first handler call", func() bool { return calls.Load() == 1 })
		h.publish("slow-1", `{}`, nil) // the redelivery, while the first handler is stuck
		h.waitEvents(20*time.Second, "takeover", func(evs []consumer.Event) bool { return countOutcomes(evs)[consumer.OutcomeProcessed] == 1 })
		close(secondDone)
		evs := h.waitEvents(20*time.Second, "lease lost and duplicate", func(evs []consumer.Event) bool {
			c := countOutcomes(evs)
			return c[consumer.OutcomeLeaseLost] == 1 && c[consumer.OutcomeDuplicate] == 1
		})
		_ = evs
		var stale int
		if err := h.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+h.schema+".ledger WHERE attempt = -1").Scan(&stale); err != nil {
			t.Fatal(err)
		}
		if eff := h.effects(); eff["slow-1"] != 1 || stale != 0 {
			t.Fatalf("effects %v, stale owner's rows %d; want 1 and 0", eff, stale)
		}
	})
}

func TestHeartbeatKeepsSlowHandlerLease(t *testing.T) {
	// Leases others can see (a held key has none: its copies wait for the
	// holder's commit, see the crash kit's "a second copy during the first").
	forModes(t, mode.Separate, func(t *testing.T, m mode) {
		h := newHarness(t, m, func(c *consumer.Config) {
			c.Lease, c.Concurrency = time.Second, 2
			c.RetryInitial = 100 * time.Millisecond
		})
		release := make(chan struct{})
		var calls atomic.Int64
		h.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			calls.Add(1)
			select {
			case <-release:
			case <-ctx.Done():
				return consumer.Response{}, ctx.Err()
			}
			return h.ledgerEffect(ctx, tx, d)
		})
		h.publish("long-1", `{}`, nil)
		consumertest.WaitFor(t, 10*time.Second, "handler start", func() bool { return calls.Load() == 1 })
		h.publish("long-1", `{}`, nil)
		// The copy keeps finding the key busy for 3 lease lengths: the heartbeat holds it.
		h.waitEvents(20*time.Second, "busy copies", func(evs []consumer.Event) bool {
			return countOutcomes(evs)[consumer.OutcomeInProgress] >= 3
		})
		if calls.Load() != 1 {
			t.Fatalf("handler ran %d times while the lease was held", calls.Load())
		}
		close(release)
		h.waitEvents(20*time.Second, "processed and duplicate", func(evs []consumer.Event) bool {
			c := countOutcomes(evs)
			return c[consumer.OutcomeProcessed] == 1 && c[consumer.OutcomeDuplicate] == 1
		})
		if eff := h.effects(); eff["long-1"] != 1 {
			t.Fatalf("effects %v", eff)
		}
	})
}

func TestRetentionGuard(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, nil)
		short, err := dedup.NewStore(h.pool, &dedup.Config{Schema: h.schema, Retention: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		cfg := h.cfg
		cfg.RetryInitial, cfg.RetryMultiplier, cfg.MaxAttempts = 10*time.Second, 5, 5 // 10s+50s+4m10s+10m
		if _, err := consumer.New(short, h.ledgerEffect, &cfg); !errors.Is(err, consumer.ErrRetentionTooShort) {
			t.Fatalf("New with 1m retention: %v, want ErrRetentionTooShort", err)
		}
		cfg.Testing.AllowShortRetention = true
		if _, err := consumer.New(short, h.ledgerEffect, &cfg); err != nil {
			t.Fatalf("New with Testing.AllowShortRetention: %v", err)
		}
	})
}

// TestNonStringKeyHeaderIsInvalid: a key header that is present but not a
// string (an AMQP integer) is an invalid key, not a missing one.
func TestNonStringKeyHeaderIsInvalid(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, nil)
		h.start(1, h.ledgerEffect)
		testamqp.Publish(t, h.pub, "", h.cfg.Queue, amqp.Publishing{
			Headers: amqp.Table{consumer.DefaultKeyHeader: int64(42)}, Body: []byte(`{}`),
		})
		evs := h.waitEvents(30*time.Second, "the dead letter", func(evs []consumer.Event) bool { return finals(evs) >= 1 })
		if ev := evs[0]; ev.Outcome != consumer.OutcomeInvalidKey || ev.Reason != consumer.ReasonKeyInvalid {
			t.Fatalf("outcome %s, reason %q; want %s, %s", ev.Outcome, ev.Reason, consumer.OutcomeInvalidKey, consumer.ReasonKeyInvalid)
		}
		dl := h.drainDLQ()
		if len(dl) != 1 {
			t.Fatalf("%d dead letters, want 1", len(dl))
		}
		if r := wire.ReadLetter(&dl[0]).Reason; r != consumer.ReasonKeyInvalid {
			t.Fatalf("dead letter reason %q, want %s", r, consumer.ReasonKeyInvalid)
		}
	})
}
