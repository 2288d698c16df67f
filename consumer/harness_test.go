package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

// harness runs consumers of one fresh queue against one fresh schema, with a
// ledger table where handlers write their effects.
type harness struct {
	t      testing.TB
	pool   *pgxpool.Pool
	store  *dedup.Store
	schema string
	cfg    consumer.Config
	conn   *amqp.Connection
	pub    *amqp.Channel
	// mode is the consumer mode start runs.
	mode mode

	mu     sync.Mutex
	events []consumer.Event
	notify chan struct{}
}

// newHarness prepares the queue and schema; mod adjusts the consumer config.
func newHarness(t testing.TB, m mode, mod func(*consumer.Config)) *harness {
	t.Helper()
	pool := testdb.Pool(t, 40)
	schemaName := testdb.Schema(t, pool)
	ctx := context.Background()
	if err := schema.Migrate(ctx, pool, schemaName); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE "+schemaName+".ledger (key text NOT NULL, tenant text NOT NULL DEFAULT '', attempt int, at timestamptz DEFAULT clock_timestamp())"); err != nil {
		t.Fatal(err)
	}
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: schemaName})
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, pool: pool, store: store, schema: schemaName, notify: make(chan struct{}, 1), mode: m}
	queue := testamqp.Name(t, "q")
	h.cfg = consumer.Config{
		URL:             testamqp.URL(),
		Queue:           queue,
		Name:            "payments",
		Concurrency:     4,
		RetryInitial:    200 * time.Millisecond,
		RetryMultiplier: 2,
		MaxAttempts:     3,
		ShutdownTimeout: 10 * time.Second,
		ConnectionName:  "idemq-test-" + queue,
		OnOutcome:       h.record,
	}
	m.Apply(&h.cfg)
	if m.Optimistic() {
		h.cfg.Group.Size = 16
	}
	if mod != nil {
		mod(&h.cfg)
	}
	topo := consumer.NewTopology(h.cfg.TopologyConfig())
	queues := []string{topo.Queue, topo.DLQ}
	for _, d := range topo.Delays {
		queues = append(queues, topo.TierName(d))
	}
	testamqp.DeleteQueuesAtCleanup(t, queues, []string{topo.DLX})
	if err := consumer.Apply(t.Context(), h.cfg.URL, h.cfg.TopologyConfig()); err != nil {
		t.Fatalf("apply topology: %v", err)
	}
	h.conn = testamqp.Dial(t)
	h.pub = testamqp.Channel(t, h.conn)
	return h
}

func (h *harness) record(ev consumer.Event) {
	h.mu.Lock()
	h.events = append(h.events, ev)
	h.mu.Unlock()
	select {
	case h.notify <- struct{}{}:
	default:
	}
}

// start runs n consumers with handler until the test ends; the returned
// stop function cancels them and waits for Run to return.
func (h *harness) start(n int, handler consumer.Handler) (stop func()) {
	h.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for range n {
		var c *consumer.Consumer
		var err error
		if h.mode.Batch() {
			c, err = consumer.NewBatch(h.store, asBatch(handler), &h.cfg)
		} else {
			c, err = consumer.New(h.store, handler, &h.cfg)
		}
		if err != nil {
			h.t.Fatalf("new consumer: %v", err)
		}
		wg.Go(func() {
			if err := c.Run(ctx); err != nil {
				h.t.Errorf("run: %v", err)
			}
		})
	}
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); wg.Wait() }) }
	h.t.Cleanup(stop)
	return stop
}

// publish sends a message with key (as message_id) to the work queue.
func (h *harness) publish(key string, body string, headers amqp.Table) {
	h.t.Helper()
	testamqp.Publish(h.t, h.pub, "", h.cfg.Queue, amqp.Publishing{MessageId: key, Body: []byte(body), Headers: headers, ContentType: "application/json"})
}

// ledgerEffect is the usual handler: one ledger row per processed key.
func (h *harness) ledgerEffect(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
	_, err := tx.Exec(ctx, "INSERT INTO "+h.schema+".ledger (key, tenant, attempt) VALUES ($1, $2, $3)", d.Key, d.Tenant, d.Attempt)
	return consumer.Response{Code: 200, Body: []byte("ok:" + d.Key)}, err
}

// waitEvents waits until cond holds over the events recorded so far.
func (h *harness) waitEvents(timeout time.Duration, what string, cond func([]consumer.Event) bool) []consumer.Event {
	h.t.Helper()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		h.mu.Lock()
		evs := append([]consumer.Event(nil), h.events...)
		h.mu.Unlock()
		if cond(evs) {
			return evs
		}
		select {
		case <-h.notify:
		case <-time.After(50 * time.Millisecond):
		case <-deadline.C:
			h.t.Fatalf("timed out after %s waiting for %s; outcomes so far: %v", timeout, what, countOutcomes(evs))
		}
	}
}

func countOutcomes(evs []consumer.Event) map[consumer.Outcome]int {
	m := map[consumer.Outcome]int{}
	for _, e := range evs {
		m[e.Outcome]++
	}
	return m
}

// final reports whether an outcome ends a message's journey (nothing more
// comes of it): everything but retries and retry-later.
func final(o consumer.Outcome) bool {
	switch o {
	case consumer.OutcomeRetried, consumer.OutcomeInProgress, consumer.OutcomeLeaseLost, "":
		return false
	}
	return true
}

func finals(evs []consumer.Event) int {
	n := 0
	for _, e := range evs {
		if final(e.Outcome) {
			n++
		}
	}
	return n
}

// effects counts ledger rows per key.
func (h *harness) effects() map[string]int {
	h.t.Helper()
	rows, err := h.pool.Query(context.Background(), "SELECT key, count(*) FROM "+h.schema+".ledger GROUP BY key")
	if err != nil {
		h.t.Fatal(err)
	}
	out := map[string]int{}
	for rows.Next() {
		var k string
		var n int
		if err := rows.Scan(&k, &n); err != nil {
			h.t.Fatal(err)
		}
		out[k] = n
	}
	return out
}

// drainDLQ reads every message in the DLQ.
func (h *harness) drainDLQ() []amqp.Delivery {
	h.t.Helper()
	ch, err := h.conn.Channel()
	if err != nil {
		h.t.Fatal(err)
	}
	defer ch.Close()
	var out []amqp.Delivery
	for {
		d, ok, err := ch.Get(h.cfg.Queue+".dlq", true)
		if err != nil {
			h.t.Fatal(err)
		}
		if !ok {
			return out
		}
		out = append(out, d)
	}
}

// waitDLQ waits until the DLQ holds n messages and returns them.
func (h *harness) waitDLQ(n int, timeout time.Duration) []amqp.Delivery {
	h.t.Helper()
	h.waitQueue(h.cfg.Queue+".dlq", timeout, fmt.Sprintf("%d dead letters", n), func(q amqp.Queue) bool { return q.Messages >= n })
	return h.drainDLQ()
}

// waitQueue polls the named queue until cond holds of it, and fails the
// test after timeout.
func (h *harness) waitQueue(name string, timeout time.Duration, what string, cond func(amqp.Queue) bool) {
	h.t.Helper()
	ch, err := h.conn.Channel()
	if err != nil {
		h.t.Fatal(err)
	}
	defer ch.Close()
	deadline := time.Now().Add(timeout)
	for {
		q, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
		if err != nil {
			h.t.Fatalf("inspect %s: %v", name, err)
		}
		if cond(q) {
			return
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("%s after %s: %d messages, %d consumers; want %s", name, timeout, q.Messages, q.Consumers, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

var errInfra = errors.New("database of the card network is down")

func keyOf(i int, prefix string) string { return fmt.Sprintf("%s-%05d", strings.TrimSpace(prefix), i) }

type pgxPoolT = pgxpool.Pool

var pgxNew = pgxpool.New

// mode is a consumer mode the tests run in: every test that runs a
// consumer runs in each (forEachMode).
type mode = consumer.Mode

const (
	modeGroup              = consumer.ModeGroup
	modeGroupSeparate      = consumer.ModeGroupSeparate
	modeSingle             = consumer.ModeSingle
	modeSingleSeparate     = consumer.ModeSingleSeparate
	modeOptimistic         = consumer.ModeOptimistic
	modeOptimisticSeparate = consumer.ModeOptimisticSeparate
	modeBatch              = consumer.ModeBatch
	modeBatchSeparate      = consumer.ModeBatchSeparate
)

// forEachMode runs test once per consumer mode, as parallel subtests.
func forEachMode(t *testing.T, test func(t *testing.T, m mode)) {
	forModes(t, func(mode) bool { return true }, test)
}

// forModes runs test once per consumer mode that which accepts.
func forModes(t *testing.T, which func(mode) bool, test func(t *testing.T, m mode)) {
	for _, m := range consumer.Modes() {
		if !which(m) {
			continue
		}
		t.Run(string(m), func(t *testing.T) {
			t.Parallel()
			test(t, m)
		})
	}
}

// asBatch turns a per-message handler into a batch handler over the same
// transaction: any failure fails the batch, which the runtime then isolates.
func asBatch(h consumer.Handler) consumer.BatchHandler {
	return func(ctx context.Context, tx pgx.Tx, ds []*consumer.Delivery) ([]consumer.Response, error) {
		out := make([]consumer.Response, len(ds))
		for i, d := range ds {
			r, err := h(ctx, tx, d)
			if err != nil {
				return nil, err
			}
			out[i] = r
		}
		return out, nil
	}
}
