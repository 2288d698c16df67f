package consumer_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
)

// The guarantees of the one pipeline, held in every mode.

// A handler cannot commit or roll back the transaction it is given, alone
// or in a group: its effects commit with its key, once. (The per-message
// path used to hand out the raw transaction: a handler's Commit committed
// its effects, the key's completion then failed, and the retry ran the
// handler again.)
func TestHandlerCannotCommitOrRollBack(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, nil)
		var mu sync.Mutex
		var refused, allowed int
		handler := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			resp, err := h.ledgerEffect(ctx, tx, d)
			if err != nil {
				return resp, err
			}
			for _, end := range []func(context.Context) error{tx.Commit, tx.Rollback} {
				mu.Lock()
				if err := end(ctx); errors.Is(err, consumer.ErrHandlerTx) {
					refused++
				} else {
					allowed++
				}
				mu.Unlock()
			}
			return resp, nil
		}
		const n = 6
		for i := range n {
			h.publish(keyOf(i, "commit"), `{}`, nil) // waiting before the start: groups form
		}
		stop := h.start(1, handler)
		h.waitEvents(30*time.Second, "every message processed", func(evs []consumer.Event) bool { return finals(evs) >= n })
		stop()
		if allowed != 0 {
			t.Errorf("%d Commit/Rollback calls of a handler were allowed", allowed)
		}
		for k, v := range h.effects() {
			if v != 1 {
				t.Errorf("key %s has %d effects, want 1", k, v)
			}
		}
		if got := len(h.effects()); got != n {
			t.Errorf("%d keys with effects, want %d", got, n)
		}
	})
}

// A lease lost under a running handler (another worker took the key over)
// cancels that handler's context with dedup.ErrLeaseLost as the cause, and
// only that one: its group-mate commits. (In the modes that hold their keys
// in the group's transaction there is no lease to lose: another worker's
// takeover waits for the row lock; TestWholeGroupsWithDuplicatesAndPoison
// covers them.)
func TestLostLeaseCancelsOnlyThatHandler(t *testing.T) {
	forModes(t, mode.Separate, func(t *testing.T, m mode) {
		h := newHarness(t, m, func(c *consumer.Config) {
			c.Lease = 1500 * time.Millisecond
			c.Concurrency = 1
			c.Group.Linger = 200 * time.Millisecond
		})
		started := make(chan struct{}, 1)
		causes := make(chan error, 4)
		handler := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			if d.Key != "stolen" {
				return h.ledgerEffect(ctx, tx, d)
			}
			select {
			case started <- struct{}{}:
			default:
			}
			select {
			case <-ctx.Done():
				causes <- context.Cause(ctx)
				return consumer.Response{}, ctx.Err()
			case <-time.After(20 * time.Second):
				causes <- errors.New("never cancelled")
				return consumer.Response{}, errors.New("never cancelled")
			}
		}
		h.publish("other", `{}`, nil)
		h.publish("stolen", `{}`, nil)
		stop := h.start(1, handler)
		select {
		case <-started:
		case <-time.After(30 * time.Second):
			t.Fatal("the handler of the stolen key never ran")
		}
		// Another worker takes the key over: a new lease token.
		if _, err := h.pool.Exec(context.Background(),
			"UPDATE "+h.schema+".keys SET lease_token = gen_random_uuid() WHERE key = 'stolen'"); err != nil {
			t.Fatal(err)
		}
		select {
		case cause := <-causes:
			if !errors.Is(cause, dedup.ErrLeaseLost) {
				t.Fatalf("handler context ended with %v, want ErrLeaseLost", cause)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("the handler was not cancelled")
		}
		evs := h.waitEvents(30*time.Second, "lease_lost and processed", func(evs []consumer.Event) bool {
			c := countOutcomes(evs)
			return c[consumer.OutcomeLeaseLost] >= 1 && c[consumer.OutcomeProcessed] >= 1
		})
		stop()
		if got := h.effects(); got["other"] != 1 || got["stolen"] != 0 {
			t.Errorf("effects %v, want other once and stolen never", got)
		}
		_ = evs
	})
}

// HandlerTimeout bounds every call of user code, in every mode.
func TestHandlerTimeoutHolds(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, func(c *consumer.Config) { c.HandlerTimeout = 300 * time.Millisecond })
		handler := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			<-ctx.Done()
			return consumer.Response{}, ctx.Err()
		}
		h.publish("slow", `{}`, nil)
		t0 := time.Now()
		stop := h.start(1, handler)
		evs := h.waitEvents(30*time.Second, "a retry", func(evs []consumer.Event) bool {
			return countOutcomes(evs)[consumer.OutcomeRetried] >= 1
		})
		stop()
		if d := time.Since(t0); d > 10*time.Second {
			t.Errorf("first retry after %s with a 300ms handler timeout", d)
		}
		if !errors.Is(evs[0].Err, consumer.ErrHandlerTimeout) {
			t.Errorf("Err = %v, want ErrHandlerTimeout", evs[0].Err)
		}
	})
}

// Groups that reserve their keys in the group's transaction (batch
// handlers and optimistic groups by default), and the same with separate
// reservations: two consumers, duplicates and a burst of copies of one key,
// a poison message in the middle of a group. Every key has one effect, the
// poison goes to the DLQ alone, nothing is left in the queue.
func TestWholeGroupsWithDuplicatesAndPoison(t *testing.T) {
	for _, m := range []mode{modeBatch, modeBatchSeparate, modeOptimistic, modeOptimisticSeparate} {
		t.Run(string(m), func(t *testing.T) {
			t.Parallel()
			testWholeGroupsWithDuplicatesAndPoison(t, m)
		})
	}
}

func testWholeGroupsWithDuplicatesAndPoison(t *testing.T, m mode) {
	h := newHarness(t, m, func(c *consumer.Config) {
		c.Group.Size, c.Group.Linger = 20, 20*time.Millisecond
	})
	handler := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		if d.Key == "poison" {
			return consumer.Response{}, consumer.Permanent(errors.New("poison"))
		}
		return h.ledgerEffect(ctx, tx, d)
	}
	const unique = 60
	published := 0
	for i := range unique {
		h.publish(keyOf(i, "tx"), `{}`, nil)
		published++
		if i%5 == 0 { // a duplicate of an earlier key
			h.publish(keyOf(i/2, "tx"), `{}`, nil)
			published++
		}
		if i == 30 {
			h.publish("poison", `{}`, nil)
			published++
			for range 10 {
				h.publish("burst", `{}`, nil)
				published++
			}
		}
	}
	stop := h.start(2, handler)
	evs := h.waitEvents(60*time.Second, "every copy settled", func(evs []consumer.Event) bool { return finals(evs) >= published })
	stop()
	eff := h.effects()
	for i := range unique {
		if n := eff[keyOf(i, "tx")]; n != 1 {
			t.Errorf("key %s: %d effects, want 1", keyOf(i, "tx"), n)
		}
	}
	if eff["burst"] != 1 || eff["poison"] != 0 {
		t.Errorf("burst %d effects (want 1), poison %d (want 0)", eff["burst"], eff["poison"])
	}
	if c := countOutcomes(evs); c[consumer.OutcomeDeadLettered] != 1 || c[consumer.OutcomeProcessed] != unique+1 {
		t.Errorf("outcomes %v, want %d processed and 1 dead-lettered", c, unique+1)
	}
	h.queueHolds(h.cfg.Queue, 0, 10*time.Second)
}

// A per-message handler that runs steps, in optimistic groups of a
// consumer that declares Steps: its keys are leases the steps see; each
// step commits once per key, every key has one effect.
func TestOptimisticGroupsWithStepsReserveSeparately(t *testing.T) {
	t.Parallel()
	h := newHarness(t, modeOptimistic, func(c *consumer.Config) {
		c.Group.Linger = 50 * time.Millisecond
		c.Steps = true
	})
	if _, err := h.pool.Exec(context.Background(), "CREATE TABLE "+h.schema+".charges (key text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	handler := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		err := d.Step(ctx, "charge", func(ctx context.Context, stx pgx.Tx) error {
			_, err := stx.Exec(ctx, "INSERT INTO "+h.schema+".charges (key) VALUES ($1)", d.Key)
			return err
		})
		if err != nil {
			return consumer.Response{}, err
		}
		return h.ledgerEffect(ctx, tx, d)
	}
	const n = 40
	for i := range n {
		h.publish(keyOf(i, "step"), `{}`, nil)
	}
	stop := h.start(1, handler)
	evs := h.waitEvents(60*time.Second, "every key settled", func(evs []consumer.Event) bool { return finals(evs) >= n })
	stop()
	if c := countOutcomes(evs); c[consumer.OutcomeProcessed] != n {
		t.Fatalf("outcomes %v, want %d processed", c, n)
	}
	eff := h.effects()
	charges := map[string]int{}
	rows, err := h.pool.Query(context.Background(), "SELECT key FROM "+h.schema+".charges")
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var k string
		if err := rows.Scan(&k); err != nil {
			t.Fatal(err)
		}
		charges[k]++
	}
	for i := range n {
		if k := keyOf(i, "step"); eff[k] != 1 || charges[k] != 1 {
			t.Errorf("key %s: %d effects, %d charges; want 1 and 1", k, eff[k], charges[k])
		}
	}
}

// A handler that calls Step on a consumer that holds its keys in the
// group's transaction (Steps not declared) gets ErrStepInBatch, in every
// mode that holds them: the step never runs, and the delivery is retried,
// then dead-lettered.
func TestStepWithoutStepsDeclared(t *testing.T) {
	forModes(t, func(m mode) bool { return !m.Separate() }, func(t *testing.T, m mode) {
		h := newHarness(t, m, nil)
		var ran atomic.Int64
		handler := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			err := d.Step(ctx, "charge", func(context.Context, pgx.Tx) error {
				ran.Add(1)
				return nil
			})
			return consumer.Response{}, err
		}
		h.publish("step-undeclared", `{}`, nil)
		stop := h.start(1, handler)
		evs := h.waitEvents(30*time.Second, "the delivery dead-lettered", func(evs []consumer.Event) bool {
			return countOutcomes(evs)[consumer.OutcomeDeadLettered] == 1
		})
		stop()
		for _, ev := range evs {
			if ev.Outcome != consumer.OutcomeRetried && ev.Outcome != consumer.OutcomeDeadLettered {
				t.Errorf("outcome %s, want retried or dead_lettered", ev.Outcome)
			}
			if !errors.Is(ev.Err, consumer.ErrStepInBatch) {
				t.Errorf("event error %v, want ErrStepInBatch", ev.Err)
			}
		}
		if n := ran.Load(); n != 0 {
			t.Errorf("the step ran %d times, want 0", n)
		}
	})
}
