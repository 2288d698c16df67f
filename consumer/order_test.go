package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
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
	"github.com/idemq/idemq/internal/ordering"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

// orderBench is a partitioned queue, a fresh schema and a ledger that
// records, in commit order, each (ordering key, sequence) a handler applied.
type orderBench struct {
	t      *testing.T
	pool   *pgxpool.Pool
	store  *dedup.Store
	schema string
	cfg    consumer.Config
	pub    *amqp.Channel

	mu     sync.Mutex
	events []consumer.Event
}

func newOrderBench(t *testing.T, partitions int, mod func(*consumer.Config)) *orderBench {
	t.Helper()
	pool := testdb.Pool(t, 20)
	schemaName := testdb.Schema(t, pool)
	ctx := context.Background()
	if err := schema.Migrate(ctx, pool, schemaName); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE "+schemaName+".applied (id bigserial PRIMARY KEY, okey text NOT NULL, seq int NOT NULL, msg text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: schemaName})
	if err != nil {
		t.Fatal(err)
	}
	b := &orderBench{t: t, pool: pool, store: store, schema: schemaName}
	queue := testamqp.Name(t, "ord")
	b.cfg = consumer.Config{
		URL: testamqp.URL(), Queue: queue, Name: "ledger", Partitions: partitions,
		Concurrency: 4, RetryInitial: 100 * time.Millisecond, RetryMultiplier: 2, MaxAttempts: 4,
		ShutdownTimeout: 10 * time.Second, ConnectionName: "idemq-test-" + queue,
		Ordering:  &consumer.Ordering{GapTimeout: 20 * time.Second},
		OnOutcome: b.record,
	}
	if mod != nil {
		mod(&b.cfg)
	}
	queues, exchanges := consumer.NewTopology(b.cfg.TopologyConfig()).Names()
	testamqp.DeleteQueuesAtCleanup(t, queues, exchanges)
	if err := consumer.Apply(t.Context(), b.cfg.URL, b.cfg.TopologyConfig()); err != nil {
		t.Fatalf("apply topology: %v", err)
	}
	b.pub = testamqp.Channel(t, testamqp.Dial(t))
	return b
}

func (b *orderBench) record(ev consumer.Event) {
	b.mu.Lock()
	b.events = append(b.events, ev)
	b.mu.Unlock()
}

func (b *orderBench) outcomes() map[consumer.Outcome]int {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := map[consumer.Outcome]int{}
	for _, ev := range b.events {
		out[ev.Outcome]++
	}
	return out
}

// apply is the handler: it records the message's place in the ledger, in
// its transaction; fail decides whether this run fails instead.
func (b *orderBench) apply(fail func(d *consumer.Delivery) error) consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		if fail != nil {
			if err := fail(d); err != nil {
				return consumer.Response{}, err
			}
		}
		seq, _ := d.Headers[consumer.HeaderSequence].(int64)
		okey, _ := d.Headers[consumer.HeaderOrderingKey].(string)
		_, err := tx.Exec(ctx, "INSERT INTO "+b.schema+".applied (okey, seq, msg) VALUES ($1, $2, $3)", okey, seq, d.MessageID)
		return consumer.Response{}, err
	}
}

// run starts n consumers of the partitioned queue until the test ends.
func (b *orderBench) run(n int, h consumer.Handler) {
	b.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for range n {
		c, err := consumer.New(b.store, h, &b.cfg)
		if err != nil {
			b.t.Fatalf("new consumer: %v", err)
		}
		wg.Go(func() {
			if err := c.Run(ctx); err != nil {
				b.t.Errorf("run: %v", err)
			}
		})
	}
	b.t.Cleanup(func() { cancel(); wg.Wait() })
}

// publish sends one event of okey to the partitions' exchange.
func (b *orderBench) publish(okey string, seq int64, msgID string) {
	h := amqp.Table{consumer.HeaderOrderingKey: okey}
	if seq > 0 {
		h[consumer.HeaderSequence] = seq
	}
	testamqp.Publish(b.t, b.pub, consumer.OrderExchange(b.cfg.Queue), "", amqp.Publishing{
		MessageId: msgID, Headers: h, Body: []byte(msgID), DeliveryMode: amqp.Persistent,
	})
}

// ledger returns each ordering key's applied sequences (or messages) in
// commit order.
func (b *orderBench) ledger() (seqs map[string][]int64, msgs map[string][]string) {
	b.t.Helper()
	rows, err := b.pool.Query(context.Background(), "SELECT okey, seq, msg FROM "+b.schema+".applied ORDER BY id")
	if err != nil {
		b.t.Fatal(err)
	}
	defer rows.Close()
	seqs, msgs = map[string][]int64{}, map[string][]string{}
	for rows.Next() {
		var k, m string
		var s int64
		if err := rows.Scan(&k, &s, &m); err != nil {
			b.t.Fatal(err)
		}
		seqs[k], msgs[k] = append(seqs[k], s), append(msgs[k], m)
	}
	return seqs, msgs
}

func (b *orderBench) waitApplied(n int, timeout time.Duration) {
	b.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		var got int
		if err := b.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+b.schema+".applied").Scan(&got); err != nil {
			b.t.Fatal(err)
		}
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			b.t.Fatalf("%d of %d applied after %s; outcomes %v", got, n, timeout, b.outcomes())
		}
		time.Sleep(50 * time.Millisecond) // polling the ledger: nothing to wait on
	}
}

// waitSettled waits until n deliveries have ended processed, suppressed as
// duplicates or dead-lettered.
func (b *orderBench) waitSettled(n int, timeout time.Duration) {
	b.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		got := b.outcomes()
		settled := got[consumer.OutcomeProcessed] + got[consumer.OutcomeDuplicate] + got[consumer.OutcomeDeadLettered]
		if settled >= n {
			return
		}
		if time.Now().After(deadline) {
			b.t.Fatalf("%d of %d deliveries settled after %s; outcomes %v", settled, n, timeout, got)
		}
		time.Sleep(50 * time.Millisecond) // polling the recorded events: nothing to wait on
	}
}

// TestOrderedSequencesApplyOnceInOrder publishes 20 keys × 30 events to a
// partitioned queue, shuffled within windows of 4, with every fifth event
// published twice (once with its own message_id again, once under a new
// one), while a handler fails some events' first runs (they go through a
// retry tier). Two consumers take the 4 partitions (one active per
// partition). Each key's ledger must read 1…30, once each.
func TestOrderedSequencesApplyOnceInOrder(t *testing.T) {
	const keys, events = 20, 30
	b := newOrderBench(t, 4, nil)
	fail := func(d *consumer.Delivery) error {
		if seq, _ := d.Headers[consumer.HeaderSequence].(int64); seq%7 == 3 && d.Attempt == 1 {
			return errors.New("the ledger's database blinked")
		}
		return nil
	}
	b.run(2, b.apply(fail))

	rng := rand.New(rand.NewPCG(1, 2))
	type ev struct {
		key string
		seq int64
	}
	var plan []ev
	for s := int64(1); s <= events; s++ {
		for k := range keys {
			plan = append(plan, ev{fmt.Sprintf("acct-%02d", k), s})
		}
	}
	// Shuffle within windows: an event may go up to a window before its
	// predecessors.
	for i := 0; i < len(plan); i += 4 * keys {
		w := plan[i:min(i+4*keys, len(plan))]
		rng.Shuffle(len(w), func(a, c int) { w[a], w[c] = w[c], w[a] })
	}
	for _, e := range plan {
		id := fmt.Sprintf("%s/%d", e.key, e.seq)
		b.publish(e.key, e.seq, id)
		if e.seq%5 == 0 {
			b.publish(e.key, e.seq, id)           // a redelivered copy
			b.publish(e.key, e.seq, id+"/resent") // a publisher's retry under a new id
		}
	}
	b.waitApplied(keys*events, 90*time.Second)
	// Every copy ends processed or suppressed; the last copies may still be
	// waiting for their predecessors when the ledger is full.
	copies := 2 * keys * events / 5
	b.waitSettled(keys*events+copies, 60*time.Second)

	seqs, _ := b.ledger()
	want := make([]int64, events)
	for i := range want {
		want[i] = int64(i + 1)
	}
	for k := range keys {
		key := fmt.Sprintf("acct-%02d", k)
		if !slices.Equal(seqs[key], want) {
			t.Errorf("%s applied %v, want 1…%d in order, once each", key, seqs[key], events)
		}
	}
	got := b.outcomes()
	if got[consumer.OutcomeRetried] == 0 {
		t.Errorf("no retries: the test did not exercise a retried predecessor (outcomes %v)", got)
	}
	if got[consumer.OutcomeDuplicate] < copies {
		t.Errorf("%d duplicates, want at least %d (outcomes %v)", got[consumer.OutcomeDuplicate], copies, got)
	}
	if got[consumer.OutcomeDeadLettered] > 0 {
		t.Errorf("dead letters: %v", got)
	}
}

// TestOrderedWithoutSequenceKeepsBrokerOrderAcrossRetries: events with an
// ordering key and no sequence run in the order they were published, one
// at a time per key, even when one fails and goes through a retry tier.
func TestOrderedWithoutSequenceKeepsBrokerOrderAcrossRetries(t *testing.T) {
	const keys, events = 5, 20
	b := newOrderBench(t, 2, nil)
	fail := func(d *consumer.Delivery) error {
		var k, n int
		if _, err := fmt.Sscanf(d.MessageID, "k%d-%d", &k, &n); err == nil && n%6 == 2 && d.Attempt < 3 {
			return errors.New("a dependency timed out")
		}
		return nil
	}
	b.run(1, b.apply(fail))
	for n := range events {
		for k := range keys {
			b.publish(fmt.Sprintf("k%d", k), 0, fmt.Sprintf("k%d-%02d", k, n))
		}
	}
	b.waitApplied(keys*events, 60*time.Second)
	_, msgs := b.ledger()
	for k := range keys {
		key := fmt.Sprintf("k%d", k)
		var want []string
		for n := range events {
			want = append(want, fmt.Sprintf("k%d-%02d", k, n))
		}
		if !slices.Equal(msgs[key], want) {
			t.Errorf("%s applied %v, want %v", key, msgs[key], want)
		}
	}
	if got := b.outcomes(); got[consumer.OutcomeRetried] == 0 {
		t.Errorf("no retries: outcomes %v", got)
	}
}

// TestOrderedGapDeadLettersAndBlocksTheKey: a sequence whose predecessor
// never comes waits GapTimeout, then goes to its partition's DLQ with the
// reason sequence_gap and the key is blocked; other keys go on; the
// missing sequence, when it comes at last, applies and unblocks the key,
// and the dead-lettered one, replayed, applies after it. A sequence that
// is no integer is dead-lettered sequence_invalid.
func TestOrderedGapDeadLettersAndBlocksTheKey(t *testing.T) {
	b := newOrderBench(t, 1, func(c *consumer.Config) {
		c.Ordering = &consumer.Ordering{GapTimeout: 700 * time.Millisecond}
	})
	b.run(1, b.apply(nil))
	b.publish("a", 1, "a1")
	b.publish("a", 3, "a3")
	b.publish("b", 1, "b1")
	b.publish("b", 2, "b2")
	testamqp.Publish(t, b.pub, consumer.OrderExchange(b.cfg.Queue), "", amqp.Publishing{
		MessageId: "c-bad", Headers: amqp.Table{consumer.HeaderOrderingKey: "c", consumer.HeaderSequence: "first"},
	})
	dlq := consumer.NewTopology(b.cfg.TopologyConfig()).Partitions[0].DLQ
	letters := waitLetters(t, b.pub, dlq, 2, 30*time.Second)
	reasons := map[string]string{}
	for _, l := range letters {
		reasons[l.MessageId], _ = l.Headers[consumer.HeaderReason].(string)
	}
	if reasons["a3"] != consumer.ReasonSequenceGap || reasons["c-bad"] != consumer.ReasonSequenceInvalid {
		t.Fatalf("dead letters %v, want a3 %s and c-bad %s", reasons, consumer.ReasonSequenceGap, consumer.ReasonSequenceInvalid)
	}
	b.waitApplied(3, 10*time.Second)
	var blocked *time.Time
	var reason *string
	if err := b.pool.QueryRow(t.Context(), "SELECT blocked_at, blocked_reason FROM "+b.schema+".ordering_keys WHERE consumer = 'ledger' AND ordering_key = 'a'").Scan(&blocked, &reason); err != nil {
		t.Fatal(err)
	}
	if blocked == nil || reason == nil || *reason != consumer.ReasonSequenceGap {
		t.Fatalf("key a: blocked_at %v, reason %v; want blocked by %s", blocked, reason, consumer.ReasonSequenceGap)
	}

	b.publish("a", 2, "a2") // late, but it fills the gap
	for _, l := range letters {
		if l.MessageId == "a3" {
			b.publish("a", 3, "a3") // the operator replays the dead letter
		}
	}
	b.waitApplied(5, 20*time.Second)
	seqs, _ := b.ledger()
	if !slices.Equal(seqs["a"], []int64{1, 2, 3}) || !slices.Equal(seqs["b"], []int64{1, 2}) {
		t.Fatalf("applied %v, want a 1 2 3 and b 1 2", seqs)
	}
	if err := b.pool.QueryRow(t.Context(), "SELECT blocked_at FROM "+b.schema+".ordering_keys WHERE consumer = 'ledger' AND ordering_key = 'a'").Scan(&blocked); err != nil {
		t.Fatal(err)
	}
	if blocked != nil {
		t.Errorf("key a still blocked after its gap was filled")
	}
}

// waitLetters reads n letters from queue (acking them), or fails after
// timeout.
func waitLetters(t *testing.T, ch *amqp.Channel, queue string, n int, timeout time.Duration) []amqp.Delivery {
	t.Helper()
	var out []amqp.Delivery
	deadline := time.Now().Add(timeout)
	for len(out) < n {
		d, ok, err := ch.Get(queue, true)
		if err != nil {
			t.Fatalf("get from %s: %v", queue, err)
		}
		if ok {
			out = append(out, d)
			continue
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d letters in %s after %s", len(out), n, queue, timeout)
		}
		time.Sleep(50 * time.Millisecond) // polling a queue: nothing to wait on
	}
	return out
}

// TestPartitionedTopology: the partitions' names and arguments.
func TestPartitionedTopology(t *testing.T) {
	topo := consumer.NewTopology(consumer.TopologyConfig{Queue: "ledger", Partitions: 3})
	if len(topo.Partitions) != 3 || topo.OrderExchange != "ledger.order" {
		t.Fatalf("partitions %d, exchange %q", len(topo.Partitions), topo.OrderExchange)
	}
	p := topo.Partitions[2]
	if p.Queue != "ledger.p2" || p.DLQ != "ledger.p2.dlq" || p.OrderExchange != "ledger.order" || !p.SingleActiveConsumer {
		t.Fatalf("partition 2: %+v", p)
	}
	if p.WorkQueueArgs()["x-single-active-consumer"] != true || p.WorkQueueArgs()["x-queue-type"] != "quorum" {
		t.Errorf("partition args %v", p.WorkQueueArgs())
	}
	if got := p.TierArgs(p.Delays[0])["x-dead-letter-routing-key"]; got != "ledger.p2" {
		t.Errorf("a partition's tier dead-letters back to %v, want ledger.p2", got)
	}
	queues, exchanges := topo.Names()
	if len(queues) != 3*(2+len(p.Delays)) || exchanges[0] != "ledger.order" || len(exchanges) != 4 {
		t.Errorf("names %v %v", queues, exchanges)
	}
	err := consumer.TopologyConfig{Queue: "q", Partitions: 2, Bindings: []consumer.Binding{{Exchange: "x"}}}.WithDefaults().Validate()
	if err == nil {
		t.Error("a partitioned queue with bindings was accepted")
	}
}

// waitOutcomes waits until at least n events of outcome o were seen.
func (b *orderBench) waitOutcomes(o consumer.Outcome, n int, timeout time.Duration) {
	b.t.Helper()
	deadline := time.Now().Add(timeout)
	for b.outcomes()[o] < n {
		if time.Now().After(deadline) {
			b.t.Fatalf("%d events %s after %s, want %d; outcomes %v", b.outcomes()[o], o, timeout, n, b.outcomes())
		}
		time.Sleep(20 * time.Millisecond) // polling the recorded events: nothing to wait on
	}
}

// TestOrderedFullWaitingRoomWaitsInATier: with room for one early message
// (MaxWaiting 1), six keys' second events come before their first. One
// waits in the consumer; the others, rather than hold the prefetch (which
// would keep out the first events they wait for) or go to the DLQ, go
// round a retry tier until their predecessors arrive. Every key applies
// 1, 2 and nothing is dead-lettered. A message that goes round longer
// than GapTimeout, counted from the first time it was found early, is
// dead-lettered sequence_gap like one that waited in the consumer.
func TestOrderedFullWaitingRoomWaitsInATier(t *testing.T) {
	const keys = 6
	b := newOrderBench(t, 1, func(c *consumer.Config) {
		c.Ordering = &consumer.Ordering{GapTimeout: 3 * time.Second, MaxWaiting: 1}
	})
	b.run(1, b.apply(nil))
	for k := range keys {
		b.publish(fmt.Sprintf("k%d", k), 2, fmt.Sprintf("k%d/2", k))
	}
	// Each second event was found early at least once; most went round.
	b.waitOutcomes(consumer.OutcomeWaiting, 2*keys, 10*time.Second)
	for k := range keys {
		b.publish(fmt.Sprintf("k%d", k), 1, fmt.Sprintf("k%d/1", k))
	}
	b.waitApplied(2*keys, 20*time.Second)
	seqs, _ := b.ledger()
	for k := range keys {
		if key := fmt.Sprintf("k%d", k); !slices.Equal(seqs[key], []int64{1, 2}) {
			t.Errorf("%s applied %v, want 1 2", key, seqs[key])
		}
	}
	if got := b.outcomes(); got[consumer.OutcomeDeadLettered] > 0 {
		t.Fatalf("dead letters while the waiting room was full: %v", got)
	}

	// Two gaps that never fill: one waits in the consumer, one goes
	// round; both reach the DLQ once GapTimeout has passed.
	start := time.Now()
	b.publish("x", 2, "x/2")
	b.publish("y", 2, "y/2")
	dlq := consumer.NewTopology(b.cfg.TopologyConfig()).Partitions[0].DLQ
	letters := waitLetters(t, b.pub, dlq, 2, 30*time.Second)
	for _, l := range letters {
		if reason, _ := l.Headers[consumer.HeaderReason].(string); reason != consumer.ReasonSequenceGap {
			t.Errorf("dead letter %s: reason %q, want %s", l.MessageId, reason, consumer.ReasonSequenceGap)
		}
	}
	if took := time.Since(start); took < 3*time.Second {
		t.Errorf("the gaps were dead-lettered after %s, before GapTimeout (3s)", took)
	}
}

// TestPartitionOwnersRecordTheActiveConsumer: two workers take the four
// partitions (single-active-consumer); each partition's row in
// partition_owners names the worker whose connection got its deliveries.
func TestPartitionOwnersRecordTheActiveConsumer(t *testing.T) {
	b := newOrderBench(t, 4, nil)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	names := []string{b.cfg.ConnectionName + "-a", b.cfg.ConnectionName + "-b"}
	for _, name := range names {
		cfg := b.cfg
		cfg.ConnectionName = name
		c, err := consumer.New(b.store, b.apply(nil), &cfg)
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			if err := c.Run(ctx); err != nil {
				t.Errorf("run: %v", err)
			}
		})
	}
	for k := range 40 {
		b.publish(fmt.Sprintf("acct-%02d", k), 1, fmt.Sprintf("acct-%02d/1", k))
	}
	b.waitApplied(40, 30*time.Second)
	deadline := time.Now().Add(10 * time.Second)
	var owners []ordering.Owner
	for len(owners) < 4 {
		var err error
		if owners, err = ordering.Owners(t.Context(), b.pool, b.schema, "ledger"); err != nil {
			t.Fatal(err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("partition owners after 10s: %+v, want the 4 partitions", owners)
		}
		time.Sleep(20 * time.Millisecond) // polling the table: nothing to wait on
	}
	for i, o := range owners {
		queue := consumer.PartitionQueue(b.cfg.Queue, i)
		if o.Queue != queue {
			t.Errorf("owner %d is of %s, want %s", i, o.Queue, queue)
		}
		suffix := fmt.Sprintf("-p%d (", i)
		if !strings.HasPrefix(o.Owner, names[0]+suffix) && !strings.HasPrefix(o.Owner, names[1]+suffix) {
			t.Errorf("%s: owner %q is neither worker's connection for the partition", queue, o.Owner)
		}
	}
}
