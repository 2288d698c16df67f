package consumer_test

import (
	"testing"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testamqp"
)

// TestConsumerSkipsADeadAddress: a list whose other address refuses every
// connect (a node that is down) consumes as one URL does, whichever address
// the shuffle tries first.
func TestConsumerSkipsADeadAddress(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, url string }{
		{"dead first", "amqp://guest:guest@127.0.0.1:1/," + testamqp.URL()},
		{"dead last", testamqp.URL() + ",amqp://guest:guest@127.0.0.1:1/"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, modeSingle, func(c *consumer.Config) { c.URL = tc.url })
			h.start(1, h.ledgerEffect)
			const n = 20
			for i := range n {
				h.publish(keyOf(i, "dead"), `{"n":1}`, nil)
			}
			h.waitEvents(30*time.Second, "every message processed", func(evs []consumer.Event) bool {
				return countOutcomes(evs)[consumer.OutcomeProcessed] == n
			})
		})
	}
}

// TestConsumerFailsOverToAnotherNode: a consumer given two addresses (two
// proxies to the broker, standing for two nodes) loses the one it is
// connected through mid-run; it resumes through the other and processes the
// rest, each key's effect exactly once, nothing lost.
func TestConsumerFailsOverToAnotherNode(t *testing.T) {
	t.Parallel()
	a, b := testamqp.NewProxy(t), testamqp.NewProxy(t)
	h := newHarness(t, modeSingle, func(c *consumer.Config) {
		c.URL = a.URL + "," + b.URL
		c.Concurrency = 2
	})
	h.start(1, h.ledgerEffect)
	const half = 50
	for i := range half {
		h.publish(keyOf(i, "failover"), `{"n":1}`, nil)
	}
	h.waitEvents(30*time.Second, "the first half processed", func(evs []consumer.Event) bool {
		return countOutcomes(evs)[consumer.OutcomeProcessed] >= half/2
	})
	// The node the consumer is on goes away: its connects are refused from
	// now on, its connections cut.
	on, other := a, b
	if b.Active() > 0 {
		on, other = b, a
	}
	if on.Active() == 0 {
		t.Fatalf("no connection through either proxy (%d, %d)", a.Active(), b.Active())
	}
	before := other.Accepted()
	on.Kill()
	for i := half; i < 2*half; i++ {
		h.publish(keyOf(i, "failover"), `{"n":1}`, nil)
	}
	h.waitEvents(60*time.Second, "every key processed", func([]consumer.Event) bool {
		return len(h.effects()) == 2*half
	})
	if other.Accepted() == before {
		t.Errorf("no connection through the other address after the failover")
	}
	effects := h.effects()
	for i := range 2 * half {
		if n := effects[keyOf(i, "failover")]; n != 1 {
			t.Errorf("key %d: %d effects, want 1", i, n)
		}
	}
	if dl := h.drainDLQ(); len(dl) != 0 {
		t.Errorf("%d dead letters, want none", len(dl))
	}
	h.mu.Lock()
	t.Logf("outcomes across the failover: %v", countOutcomes(h.events))
	h.mu.Unlock()
}
