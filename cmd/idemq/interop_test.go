package main_test

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

// interopFixture reads a framework's message body from the consumer's
// fixtures (consumer/testdata/interop/README.md says where each comes from).
func interopFixture(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "consumer", "testdata", "interop", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// idemq forward --key-from masstransit forwards a MassTransit message once
// although MassTransit's redelivery sent it again with a new message_id,
// and forwards the next order.
func TestForwardKeyFromMassTransit(t *testing.T) {
	t.Parallel()
	schema := newSchema(t)
	q := testamqp.Name(t, "cli-mt")
	x := q + ".out"
	out := q + ".sink"
	deleteTopologyAtCleanup(t, q, []string{"200ms"}, []string{out}, []string{x})
	environ := env(schema)
	topo := []string{"--queue", q, "--max-attempts", "2", "--retry-initial", "200ms"}
	mustRun(t, environ, append([]string{"topology", "apply"}, topo...)...)
	conn := testamqp.Dial(t)
	ch := testamqp.Channel(t, conn)
	testamqp.Sink(t, ch, x, amqp.ExchangeFanout, out, "")

	name := "mt-" + testdb.RandomHex(4)
	fwd := start(t, "forwarder", environ, append([]string{"forward", "--consumer", name, "--to-exchange", x,
		"--key-from", "masstransit", "--concurrency", "1", "--group-size", "1"}, topo...)...)
	consumertest.WaitFor(t, 30*time.Second, "the forwarder consuming", func() bool {
		_, c := queueState(t, conn, q)
		return c == 1
	})
	const first, resent, other = "181c0000-6393-3630-36a4-08daf4e7c6da", "181c0000-6393-3630-9b2e-08daf4e7d1f3", "181c0000-6393-3630-51c7-08daf4e8a0b2"
	mt := "application/vnd.masstransit+json"
	for _, m := range []amqp.Publishing{
		{MessageId: first, ContentType: mt, Body: interopFixture(t, "masstransit-submit-order.json")},
		{MessageId: resent, ContentType: mt, Headers: amqp.Table{"MT-OriginalMessageId": first}, Body: interopFixture(t, "masstransit-submit-order-redelivered.json")},
		{MessageId: other, ContentType: mt, Body: interopFixture(t, "masstransit-submit-order-other.json")},
	} {
		testamqp.Publish(t, ch, "", q, m)
	}
	// One worker takes the messages in order: once the last one is
	// forwarded and Q is empty, the redelivery was settled too.
	consumertest.WaitFor(t, 30*time.Second, "the last order forwarded", func() bool {
		n, _ := queueState(t, conn, out)
		m, _ := queueState(t, conn, q)
		return n >= 2 && m == 0 && testamqp.Unacked(t, q) == 0
	})
	var ids []string
	for _, d := range drain(t, conn, out) {
		ids = append(ids, d.MessageId)
	}
	slices.Sort(ids)
	if want := []string{first, other}; !slices.Equal(ids, want) {
		t.Errorf("forwarded %v, want %v", ids, want)
	}
	if n, _ := queueState(t, conn, q+".dlq"); n != 0 {
		t.Errorf("%d dead letters", n)
	}
	fwd.signal(t, os.Interrupt)
	if code := fwd.wait(t, 30*time.Second); code != 0 {
		t.Fatalf("forwarder exited %d", code)
	}
}
