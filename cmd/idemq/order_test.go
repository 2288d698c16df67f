package main_test

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testamqp"
)

// TestForwardOrderedKeepsEachKeysOrder is the contract of DESIGN section
// 12 through the binary: a publisher of its own sends 40 keys × 25 events
// to Q.order, shuffled within windows of 3 events and with duplicates (the
// same message_id again, and the same sequence under a new message_id),
// while `idemq forward --partitions 4 --ordered` is SIGKILLed once and
// started again. Downstream, each key's events arrive in sequence order,
// each sequence once; the only repeat allowed is a copy that a killed
// relay published again (the same message_id, right behind the first).
func TestForwardOrderedKeepsEachKeysOrder(t *testing.T) {
	const keys, events = 40, 25
	schema := newSchema(t)
	queue := testamqp.Name(t, "ordq")
	sink := testamqp.Name(t, "ordsink")
	queues, exchanges := consumer.NewTopology(consumer.TopologyConfig{Queue: queue, Partitions: 4}).Names()
	testamqp.DeleteQueuesAtCleanup(t, append(queues, sink), exchanges)
	mustRun(t, env(schema), "topology", "apply", "--queue", queue, "--partitions", "4")
	conn := testamqp.Dial(t)
	ch := testamqp.Channel(t, conn)
	if _, err := ch.QueueDeclare(sink, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	args := []string{"forward", "--queue", queue, "--partitions", "4", "--ordered", "--gap-timeout", "1m",
		"--consumer", "ordfwd", "--to-exchange", "", "--to-routing-key", sink, "--retry-initial", "200ms"}
	fwd := start(t, "forward", env(schema), args...)

	type event struct {
		key string
		seq int64
	}
	var plan []event
	for s := int64(1); s <= events; s++ {
		for k := range keys {
			plan = append(plan, event{fmt.Sprintf("order-%02d", k), s})
		}
	}
	rng := rand.New(rand.NewPCG(7, 11))
	for i := 0; i < len(plan); i += 3 * keys {
		w := plan[i:min(i+3*keys, len(plan))]
		rng.Shuffle(len(w), func(a, b int) { w[a], w[b] = w[b], w[a] })
	}
	publish := func(e event, id string) {
		testamqp.Publish(t, ch, consumer.OrderExchange(queue), "", amqp.Publishing{
			MessageId: id, Body: []byte(id), DeliveryMode: amqp.Persistent,
			Headers: amqp.Table{consumer.HeaderOrderingKey: e.key, consumer.HeaderSequence: e.seq},
		})
	}
	for i, e := range plan {
		id := fmt.Sprintf("%s/%d", e.key, e.seq)
		publish(e, id)
		if e.seq%4 == 0 {
			publish(e, id)
			publish(e, id+"/again")
		}
		if i == len(plan)/2 {
			fwd.signal(t, syscall.SIGKILL)
			fwd.wait(t, 10*time.Second)
			fwd = start(t, "forward again", env(schema), args...)
		}
	}

	got := map[string][]amqp.Delivery{}
	deliveries, err := ch.Consume(sink, "", true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	distinct := map[string]bool{}
	deadline := time.After(2 * time.Minute)
	for len(distinct) < keys*events {
		select {
		case d := <-deliveries:
			k, _ := d.Headers[consumer.HeaderOrderingKey].(string)
			got[k] = append(got[k], d)
			distinct[fmt.Sprint(k, "/", d.Headers[consumer.HeaderSequence])] = true
		case <-deadline:
			t.Fatalf("%d of %d events downstream after 2m", len(distinct), keys*events)
		}
	}
	for k := range keys {
		key := fmt.Sprintf("order-%02d", k)
		var want int64 = 1
		var prevID string
		for _, d := range got[key] {
			seq, _ := d.Headers[consumer.HeaderSequence].(int64)
			if d.MessageId == prevID && seq == want-1 {
				continue // a relay's second copy of what it published before it was killed
			}
			if seq != want {
				var seqs []string
				for _, d := range got[key] {
					seqs = append(seqs, fmt.Sprint(d.Headers[consumer.HeaderSequence]))
				}
				t.Fatalf("%s downstream: %s, want 1…%d in order", key, strings.Join(seqs, " "), events)
			}
			prevID = d.MessageId
			want++
		}
		if want != events+1 {
			t.Fatalf("%s: %d events downstream, want %d", key, want-1, events)
		}
	}
	fwd.signal(t, syscall.SIGTERM)
	if code := fwd.wait(t, 30*time.Second); code != 0 {
		t.Errorf("forward exited %d", code)
	}
	// Nothing waits, nothing is blocked, no dead letter.
	r := mustRun(t, env(schema), "order", "status")
	if !strings.Contains(r.stdout, "no ordering key is blocked") {
		t.Errorf("order status: %s", r)
	}
	for i := range 4 {
		if n, _ := queueState(t, conn, consumer.PartitionQueue(queue, i)+".dlq"); n != 0 {
			t.Errorf("partition %d: %d dead letters", i, n)
		}
	}
}

// TestOrderStatusAndSkip: a key whose sequence 2 never came is blocked
// after the gap timeout; `order status` lists it (and the partition's
// active consumer), `order skip` moves it to 2 with a record, and its dead
// letter, replayed, applies as 3.
func TestOrderStatusAndSkip(t *testing.T) {
	schema := newSchema(t)
	queue := testamqp.Name(t, "ordskip")
	sink := testamqp.Name(t, "ordskipsink")
	queues, exchanges := consumer.NewTopology(consumer.TopologyConfig{Queue: queue, Partitions: 1}).Names()
	testamqp.DeleteQueuesAtCleanup(t, append(queues, sink), exchanges)
	mustRun(t, env(schema), "topology", "apply", "--queue", queue, "--partitions", "1")
	conn := testamqp.Dial(t)
	ch := testamqp.Channel(t, conn)
	if _, err := ch.QueueDeclare(sink, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	start(t, "forward", env(schema), "forward", "--queue", queue, "--partitions", "1", "--ordered", "--gap-timeout", "500ms",
		"--consumer", "skipper", "--to-exchange", "", "--to-routing-key", sink)
	for _, s := range []int64{1, 3} {
		testamqp.Publish(t, ch, consumer.OrderExchange(queue), "", amqp.Publishing{
			MessageId: fmt.Sprint("acct-7/", s), Headers: amqp.Table{consumer.HeaderOrderingKey: "acct-7", consumer.HeaderSequence: s},
		})
	}
	dlq := consumer.PartitionQueue(queue, 0) + ".dlq"
	deadline := time.Now().Add(30 * time.Second)
	for {
		if n, _ := queueState(t, conn, dlq); n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("sequence 3 not dead-lettered after 30s")
		}
		time.Sleep(100 * time.Millisecond) // polling a queue: nothing to wait on
	}
	r := mustRun(t, env(schema), "order", "status")
	// The partition's active consumer, as the forwarder recorded it.
	for _, want := range []string{"skipper", "acct-7", consumer.ReasonSequenceGap, "ACTIVE CONSUMER", consumer.PartitionQueue(queue, 0) + "  "} {
		if !strings.Contains(r.stdout, want) {
			t.Fatalf("order status lacks %q:\n%s", want, r)
		}
	}
	if r := idemq(t, env(schema), "order", "skip", "--consumer", "skipper", "--key", "acct-7", "--to", "0"); r.code != 2 {
		t.Errorf("a skip backwards: %s, want exit 2", r)
	}
	r = mustRun(t, env(schema), "order", "skip", "--consumer", "skipper", "--key", "acct-7", "--to", "2", "--by", "oncall", "--note", "2 was never sent")
	if !strings.Contains(r.stdout, "1 → 2") {
		t.Errorf("order skip: %s", r)
	}
	if r := mustRun(t, env(schema), "audit", "--action", "order.skip"); !strings.Contains(r.stdout, "oncall") || !strings.Contains(r.stdout, `ordering key "acct-7" (tenant "") to 2`) {
		t.Errorf("the skip is not in the audit: %s", r)
	}
	r = mustRun(t, env(schema), "order", "status", "--consumer", "skipper", "--key", "acct-7")
	if !strings.Contains(r.stdout, "blocked       no") && !strings.Contains(r.stdout, "blocked\tno") && !strings.Contains(r.stdout, "no\n") {
		t.Errorf("after the skip: %s", r)
	}
	mustRun(t, env(schema), "dlq", "replay", "--queue", consumer.PartitionQueue(queue, 0))
	var seqs []int64
	deadline = time.Now().Add(30 * time.Second)
	for len(seqs) < 2 {
		for _, d := range drain(t, conn, sink) {
			s, _ := d.Headers[consumer.HeaderSequence].(int64)
			seqs = append(seqs, s)
		}
		if time.Now().After(deadline) {
			t.Fatalf("downstream %v after 30s, want 1 then 3", seqs)
		}
		time.Sleep(100 * time.Millisecond) // polling a queue: nothing to wait on
	}
	if seqs[0] != 1 || seqs[1] != 3 {
		t.Fatalf("downstream %v, want 1 then 3", seqs)
	}
}
