package outbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/outbox"
)

// TestRelaySkipsADeadAddress: a relay given a list with an address that
// refuses every connect publishes everything, whichever order it tries.
func TestRelaySkipsADeadAddress(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, url string }{
		{"dead first", "amqp://guest:guest@127.0.0.1:1/," + testamqp.URL()},
		{"dead last", testamqp.URL() + ",amqp://guest:guest@127.0.0.1:1/"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			const n = 200
			e := newEnv(t, 8)
			startRelayURL(t, e.ob, tc.url, e.relayConfig(t))
			c := e.collect(t)
			committed, _ := e.enqueueRows(t, n, 2, 20, 0)
			e.waitAllPublished(t, c, committed, n)
		})
	}
}

// TestRelayFailsOverToAnotherNode: the node a relay publishes through goes
// away mid-run; its lanes resume through the other address of the list and
// every row is published, none lost.
func TestRelayFailsOverToAnotherNode(t *testing.T) {
	t.Parallel()
	const n = 2000
	a, b := testamqp.NewProxy(t), testamqp.NewProxy(t)
	e := newEnv(t, 8)
	cfg := e.relayConfig(t)
	cfg.BatchSize = 50
	cfg.ReconnectInitial = 50 * time.Millisecond
	r := startRelayURL(t, e.ob, a.URL+","+b.URL, cfg)
	c := e.collect(t)

	done := make(chan []string, 1)
	go func() {
		ids, _ := e.enqueueRows(t, n, 4, 25, 0)
		done <- ids
	}()
	waitFor(t, 30*time.Second, "300 messages", func() bool {
		_, total := c.counts()
		return total >= 300
	})
	on, other := a, b
	if a.Active() == 0 {
		on, other = b, a
	}
	on.Kill()
	committed := <-done
	dups := e.waitAllPublished(t, c, committed, n)
	if other.Active() == 0 {
		t.Errorf("no connection through the address left")
	}
	s, err := r.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d messages, %d republished after the failover (same message id), %d reconnects", n, dups, s.Reconnects)
}

// TestNewRelayRefusesABadURLInTheList names the bad URL without its
// credentials.
func TestNewRelayRefusesABadURLInTheList(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	_, err := outbox.NewRelay(e.ob, testamqp.URL()+",http://user:s3cret@node2/", nil)
	if err == nil || strings.Contains(err.Error(), "s3cret") || !strings.Contains(err.Error(), "http://xxxxx@node2/") {
		t.Fatalf("NewRelay: %v; want an error naming the bad URL, redacted", err)
	}
}
