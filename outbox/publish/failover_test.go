package publish_test

import (
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/outbox/publish"
)

// TestPublishFailsOverToAnotherNode: a publisher given a dead address and
// two proxies to the broker (three nodes, one down) publishes; when the node
// it is connected through goes away, the next publishes go through the one
// left; every message arrives.
func TestPublishFailsOverToAnotherNode(t *testing.T) {
	t.Parallel()
	ch := testamqp.Channel(t, testamqp.Dial(t))
	q := declareQueue(t, ch, nil)
	a, b := testamqp.NewProxy(t), testamqp.NewProxy(t)
	p, err := publish.New("amqp://guest:s3cret@127.0.0.1:1/,"+a.URL+","+b.URL,
		&publish.Config{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	const n = 20
	for i := range n {
		if i == n/2 {
			on := a
			if b.Active() > 0 {
				on = b
			}
			if on.Active() == 0 {
				t.Fatalf("no connection through either proxy")
			}
			on.Kill()
		}
		if err := p.Publish(t.Context(), fmt.Sprintf("failover-%d", i), publish.Message{RoutingKey: q, Body: []byte("x")}); err != nil {
			t.Fatalf("publish %d: %v", i, err)
		}
	}
	got := map[string]bool{}
	for range n {
		got[get(t, ch, q).MessageId] = true
	}
	if len(got) != n {
		t.Fatalf("%d distinct messages arrived, want %d", len(got), n)
	}
}

// TestNewRefusesABadURLInTheList: a bad URL anywhere in the list is refused
// by New, named without its credentials.
func TestNewRefusesABadURLInTheList(t *testing.T) {
	t.Parallel()
	_, err := publish.New(testamqp.URL()+",amqp://user:s3cret@host:port:bad/", nil)
	if err == nil || strings.Contains(err.Error(), "s3cret") || !strings.Contains(err.Error(), "2 of 2") {
		t.Fatalf("New: %v; want an error naming the second URL, redacted", err)
	}
}
