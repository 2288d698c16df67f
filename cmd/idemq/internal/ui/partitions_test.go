package ui_test

import (
	"context"
	"errors"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/cmd/idemq/internal/ui"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/ordering"
	"github.com/idemq/idemq/internal/testamqp"
)

// lastSeen is p0's owner seen seconds ago (3 when the test inserted it).
var lastSeen = regexp.MustCompile(`<td>last seen [0-9]+s ago</td>`)

// ledger is the consumer scope of the partitioned test queue.
const ledger = "ledger"

// partitioned declares a queue of n partitions (deleted when the test ends)
// and returns its topology.
func partitioned(t *testing.T, n int, classic bool) consumer.Topology {
	t.Helper()
	tc := consumer.TopologyConfig{Queue: testamqp.Name(t, "idemq-test-ui-ordered"), Partitions: n, ClassicQueues: classic}
	topo := consumer.NewTopology(tc)
	queues, exchanges := topo.Names()
	testamqp.DeleteQueuesAtCleanup(t, queues, exchanges)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := consumer.Apply(ctx, testamqp.URL(), tc); err != nil {
		t.Fatalf("topology: %v", err)
	}
	return topo
}

// The overview of a partitioned queue: each partition with its depths, its
// active consumer as the consumers recorded it, a flag on a partition whose
// messages no one takes, and the consumer's blocked keys with their gaps.
// Each partition's dead letters are a page of their own.
func TestOverviewShowsPartitions(t *testing.T) {
	t.Parallel()
	topo := partitioned(t, 2, false)
	p0, p1 := topo.Partitions[0], topo.Partitions[1]
	e := newEnv(t, func(c *ui.Config) {
		c.Queues = append(c.Queues, ui.Queue{Topology: topo, Consumer: ledger})
	})
	ctx := context.Background()

	// p0's active consumer recorded itself 3 s ago; two workers consume it
	// (a quorum queue counts the active one only). p1 holds a message that
	// no one consumes.
	if _, err := e.pool.Exec(ctx, `INSERT INTO `+e.schema+`.partition_owners (consumer, queue, owner, since, seen_at)
VALUES ($1, $2, 'idemq-ledger-p0 (host-a, pid 123)', now() - interval '5 minutes', now() - interval '3 seconds')`, ledger, p0.Queue); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		ch := testamqp.Channel(t, e.conn)
		if _, err := ch.Consume(p0.Queue, "", false, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	testamqp.Publish(t, e.ch, "", p1.Queue, amqp.Publishing{MessageId: "entry-1", Body: []byte("{}"),
		Headers: amqp.Table{ordering.HeaderKey: "acct-9", ordering.HeaderSequence: int64(1)}})
	e.waitReady(p1.Queue, 1)

	// acct-<42> applied 1…3, then 7 was dead-lettered: 4, 5 and 6 are
	// missing. acct-43 applied 1, then 2 was dead-lettered: nothing missing.
	advance := func(s ordering.Scope, seqs ...int64) {
		t.Helper()
		for _, seq := range seqs {
			if v, _, err := ordering.Advance(ctx, e.pool, e.schema, s, seq); err != nil || v != ordering.Next {
				t.Fatalf("advance %s to %d: %v %v", s.Key, seq, v, err)
			}
		}
	}
	gap := ordering.Scope{Consumer: ledger, Tenant: "acme", Key: "acct-<42>"}
	advance(gap, 1, 2, 3)
	if err := ordering.Block(ctx, e.pool, e.schema, gap, 7, "sequence_gap"); err != nil {
		t.Fatal(err)
	}
	next := ordering.Scope{Consumer: ledger, Key: "acct-43"}
	advance(next, 1)
	if err := ordering.Block(ctx, e.pool, e.schema, next, 2, "permanent_error"); err != nil {
		t.Fatal(err)
	}

	p := e.get("/")
	if p.code != http.StatusOK {
		t.Fatalf("overview: %d\n%s", p.code, p.body)
	}
	mustContain(t, p,
		`id="queue-`+topo.Queue+`"`, "2 partitions, published to "+topo.OrderExchange,
		// p0: empty, its owner, its active consumer.
		`<tbody id="partition-`+p0.Queue+`">`,
		`<td class="n">0</td><td class="n">1 active</td>`,
		`<a href="/dlq?queue=`+p0.Queue+`">0</a>`,
		`<td class="owner">idemq-ledger-p0 (host-a, pid 123)</td>`,
		// p1: one ready message, no consumer: flagged.
		`<tbody id="partition-`+p1.Queue+`" class="warn">`,
		`<td class="n">1</td><td class="n">0</td>`, "1 ready, no consumer",
		`<a href="/dlq?queue=`+p1.Queue+`">0</a>`,
		// The blocked keys, the key escaped.
		`<td class="mono">acct-&lt;42&gt;</td><td class="n">3</td><td class="n">4</td><td>4 … 6</td><td class="n">7</td><td>sequence_gap</td>`,
		`<td class="mono">acct-43</td><td class="n">1</td><td class="n">2</td><td>none</td><td class="n">2</td><td>permanent_error</td>`,
		"idemq order skip --consumer "+ledger,
		// The queue that is not partitioned is shown as before.
		`<td>`+e.topo.Queue+` (work)</td>`,
	)
	mustNotContain(t, p, "acct-<42>", `class="error"`, "No ordering key is blocked")
	if !lastSeen.MatchString(p.body) {
		t.Fatalf("p0's owner: no %s in:\n%s", lastSeen, p.body)
	}

	// Each partition's DLQ is a queue of the UI's, in the menu through its
	// queue's card.
	for _, part := range topo.Partitions {
		if p := e.get("/dlq?queue=" + url.QueryEscape(part.Queue)); p.code != http.StatusOK {
			t.Fatalf("/dlq?queue=%s: %d\n%s", part.Queue, p.code, p.body)
		}
	}
	mustContain(t, e.get("/dlq?queue="+url.QueryEscape(p1.Queue)), "0 dead letters in "+p1.DLQ, `href="/#queue-`+topo.Queue+`"`)
	if p := e.get("/dlq?queue=" + url.QueryEscape(topo.Queue)); p.code != http.StatusNotFound {
		t.Fatalf("/dlq of the partitioned queue itself: %d", p.code)
	}

	// A store without the owners' table: a line in the card, not a broken page.
	if _, err := e.pool.Exec(ctx, `DROP TABLE `+e.schema+`.partition_owners`); err != nil {
		t.Fatal(err)
	}
	p = e.get("/")
	if p.code != http.StatusOK {
		t.Fatalf("overview without partition_owners: %d\n%s", p.code, p.body)
	}
	mustContain(t, p, `<p class="error">active consumers not read: the store lacks migration 011`,
		`<tbody id="partition-`+p1.Queue+`" class="warn">`, "acct-43")
}

// A partitioned queue with no blocked key says so; more than the overview
// shows are counted as more.
func TestOverviewBlockedKeysBounded(t *testing.T) {
	t.Parallel()
	topo := partitioned(t, 1, false)
	e := newEnv(t, func(c *ui.Config) {
		c.Queues = append(c.Queues, ui.Queue{Topology: topo, Consumer: ledger})
	})
	mustContain(t, e.get("/"), "No ordering key is blocked")
	ctx := context.Background()
	for i := range 21 {
		s := ordering.Scope{Consumer: ledger, Key: "acct-" + string(rune('a'+i))}
		if err := ordering.Block(ctx, e.pool, e.schema, s, 2, "sequence_gap"); err != nil {
			t.Fatal(err)
		}
	}
	p := e.get("/")
	mustContain(t, p, "acct-a", "acct-t", "The 20 longest blocked; there are more")
	mustNotContain(t, p, "acct-u")
}

// A classic partition counts the workers standing by beside the active one.
func TestOverviewCountsStandingBy(t *testing.T) {
	t.Parallel()
	topo := partitioned(t, 1, true)
	e := newEnv(t, func(c *ui.Config) {
		c.Queues = append(c.Queues, ui.Queue{Topology: topo})
	})
	for range 3 {
		if _, err := testamqp.Channel(t, e.conn).Consume(topo.Partitions[0].Queue, "", false, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	p := e.get("/")
	mustContain(t, p, `<td class="n">0</td><td class="n">1 active + 2 standing by</td>`)
	// Without a consumer scope, no blocked keys are listed.
	mustNotContain(t, p, "Blocked ordering keys", `class="error"`)
}

// A broker that does not answer is said once in a partitioned queue's card,
// not per partition, and flagged once; the partitions are still listed.
func TestOverviewPartitionsWithoutBroker(t *testing.T) {
	t.Parallel()
	topo := consumer.NewTopology(consumer.TopologyConfig{Queue: "idemq-test-ui-unreached", Partitions: 3})
	var dials atomic.Int32
	e := newEnv(t, func(c *ui.Config) {
		c.Queues = []ui.Queue{{Topology: topo, Consumer: ledger}}
		c.Dial = func() (*amqp.Connection, error) {
			dials.Add(1)
			return nil, errors.New("broker refused")
		}
	})
	p := e.get("/")
	_, card, _ := strings.Cut(p.body, "<h2>Queues</h2>")
	if p.code != http.StatusOK || strings.Count(card, "broker refused") != 1 || dials.Load() != 1 {
		t.Fatalf("overview (%d, %d dials) should say the broker error once:\n%s", p.code, dials.Load(), p.body)
	}
	mustContain(t, p, `<tbody id="partition-idemq-test-ui-unreached.p2">`, `<td colspan="2" class="error">not read</td>`, "No ordering key is blocked",
		`1 thing(s) need you: messages are not moving`, `idemq-test-ui-unreached cannot be read: broker refused`)
}
