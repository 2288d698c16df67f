package main_test

import (
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/internal/testamqp"
	amqp "github.com/rabbitmq/amqp091-go"
)

// deadMQ is a broker address nothing listens on: a node that is down.
const deadMQ = "amqp://idemq:s3cret@127.0.0.1:1/"

// TestSeveralBrokerAddresses: --amqp-url takes a list (the flag repeated, or
// commas, in the flag or in IDEMQ_AMQP_URL) whose dead address is skipped,
// in either order: topology apply, publish and forward work through it.
func TestSeveralBrokerAddresses(t *testing.T) {
	t.Parallel()
	schema := newSchema(t)
	q := testamqp.Name(t, "cli-urls")
	x := q + ".out"
	out := q + ".sink"
	deleteTopologyAtCleanup(t, q, []string{"200ms", "400ms"}, []string{out}, []string{x})
	topo := []string{"--queue", q, "--max-attempts", "3", "--retry-initial", "200ms", "--retry-multiplier", "2"}

	// The flag repeated, dead address first.
	mustRun(t, env(schema), append([]string{"topology", "apply", "--amqp-url", deadMQ, "--amqp-url", testamqp.URL()}, topo...)...)

	conn := testamqp.Dial(t)
	ch := testamqp.Channel(t, conn)
	testamqp.Sink(t, ch, x, amqp.ExchangeFanout, out, "")

	// The environment, comma-separated, dead address last.
	environ := env(schema, "IDEMQ_AMQP_URL="+testamqp.URL()+","+deadMQ)
	fwd := start(t, "forwarder", environ, append([]string{"forward", "--consumer", "urls", "--to-exchange", x, "--shutdown-timeout", "10s", "--drain-timeout", "5s"}, topo...)...)
	consumertest.WaitFor(t, 30*time.Second, "the forwarder consuming "+q, func() bool {
		_, c := queueState(t, conn, q)
		return c == 1
	})
	// One flag with commas, dead address first.
	const n = 5
	for i := range n {
		mustRun(t, env(schema), "publish", "--amqp-url", deadMQ+","+testamqp.URL(), "--queue", q, "--key", fmt.Sprintf("k-%d", i), "--body", `{"n":1}`, "--copies", "2")
	}
	consumertest.WaitFor(t, 30*time.Second, fmt.Sprintf("%d messages forwarded to %s", n, out), func() bool {
		m, _ := queueState(t, conn, out)
		return m == n
	})
	fwd.signal(t, syscall.SIGTERM)
	if code := fwd.wait(t, 30*time.Second); code != 0 {
		t.Fatalf("forwarder exit %d:\n%s", code, fwd.stderr.String())
	}
	if strings.Contains(fwd.stderr.String(), "s3cret") {
		t.Errorf("the forwarder's logs carry a password:\n%s", fwd.stderr.String())
	}
	got := map[string]int{}
	for _, d := range drain(t, conn, out) {
		got[d.MessageId]++
	}
	for i := range n {
		if c := got[fmt.Sprintf("k-%d", i)]; c != 1 {
			t.Errorf("key k-%d forwarded %d times, want once", i, c)
		}
	}
}

// TestBadBrokerURLInTheListExits2: a malformed URL anywhere in the list is
// bad usage, named without credentials, before any connect.
func TestBadBrokerURLInTheListExits2(t *testing.T) {
	t.Parallel()
	bad := "http://idemq:s3cret@node2:5672/"
	for _, tc := range []struct {
		name string
		env  []string
		args []string
	}{
		{"topology, flag", nil, []string{"topology", "apply", "--queue", "q", "--amqp-url", testamqp.URL() + "," + bad}},
		{"topology, repeated flag", nil, []string{"topology", "apply", "--queue", "q", "--amqp-url", testamqp.URL(), "--amqp-url", bad}},
		{"publish, env", []string{"IDEMQ_AMQP_URL=" + bad + "," + testamqp.URL()}, []string{"publish", "--queue", "q", "--key", "k", "--body", "x"}},
		{"forward, env", []string{"IDEMQ_AMQP_URL=" + testamqp.URL() + "," + bad}, []string{"forward", "--queue", "q", "--consumer", "c", "--to-exchange", "x"}},
		{"relay, empty entry", []string{"IDEMQ_AMQP_URL=" + deadMQ + ",,"}, []string{"relay"}},
		{"dlq list", nil, []string{"dlq", "list", "--queue", "q", "--amqp-url", bad}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := idemq(t, env("idemq", tc.env...), tc.args...)
			if r.code != 2 {
				t.Fatalf("want exit 2: %s", r)
			}
			if strings.Contains(r.stderr, "s3cret") || !strings.Contains(r.stderr, "--amqp-url") {
				t.Fatalf("want a message about --amqp-url without the password: %s", r)
			}
		})
	}
}

// TestUnreachableBrokerListNamesEachAddress: when no address of the list
// answers, the one-line error names each, redacted.
func TestUnreachableBrokerListNamesEachAddress(t *testing.T) {
	t.Parallel()
	r := idemq(t, env("idemq", "IDEMQ_AMQP_URL="+deadMQ+",amqp://idemq:s3cret@127.0.0.1:2/"), "topology", "apply", "--queue", "q")
	if r.code != 1 {
		t.Fatalf("want exit 1: %s", r)
	}
	for _, want := range []string{"cannot reach RabbitMQ at ", "amqp://xxxxx@127.0.0.1:1/", "amqp://xxxxx@127.0.0.1:2/", "connection refused"} {
		if !strings.Contains(r.stderr, want) {
			t.Errorf("stderr lacks %q: %s", want, r)
		}
	}
	if strings.Contains(r.stderr, "s3cret") {
		t.Errorf("stderr carries the password: %s", r)
	}
}
