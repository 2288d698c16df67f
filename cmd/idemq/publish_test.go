package main_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/testamqp"
)

// TestPublish publishes copies of one message, concurrently, to a work
// queue and checks what arrived: every copy confirmed, same key, body,
// tenant and headers.
func TestPublish(t *testing.T) {
	t.Parallel()
	q := testamqp.Name(t, "cli-pub")
	testamqp.DeleteQueuesAtCleanup(t, []string{q}, nil)
	conn := testamqp.Dial(t)
	ch := testamqp.Channel(t, conn)
	if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	environ := env("idemq")

	r := mustRun(t, environ, "publish", "--queue", q, "--key", "order-1001", "--body", `{"amount":4200}`,
		"--copies", "7", "--concurrency", "3", "--tenant", "acme", "--header", "source=manual", "--content-type", "application/json")
	if !strings.Contains(r.stdout, "published 7 of 7 to queue "+q+": 7 confirmed") {
		t.Fatalf("want 7 confirmed: %s", r)
	}
	if strings.Contains(r.stdout+r.stderr, "order-1001") {
		t.Errorf("the raw key is printed: %s", r)
	}
	got := drain(t, conn, q)
	if len(got) != 7 {
		t.Fatalf("want 7 copies in %s, got %d", q, len(got))
	}
	for _, d := range got {
		if d.MessageId != "order-1001" || string(d.Body) != `{"amount":4200}` || d.ContentType != "application/json" ||
			d.DeliveryMode != amqp.Persistent || d.Headers["x-tenant-id"] != "acme" || d.Headers["source"] != "manual" {
			t.Errorf("copy: id %q body %q type %q mode %d headers %v", d.MessageId, d.Body, d.ContentType, d.DeliveryMode, d.Headers)
		}
	}

	// The body from a file, through an exchange; no key at all.
	file := filepath.Join(t.TempDir(), "payment.json")
	if err := os.WriteFile(file, []byte(`{"from":"file"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind(q, q, "amq.direct", false, nil); err != nil {
		t.Fatal(err)
	}
	r = mustRun(t, environ, "publish", "--exchange", "amq.direct", "--routing-key", q, "--key", "", "--body", "@"+file)
	if !strings.Contains(r.stdout, "1 confirmed") {
		t.Fatalf("want 1 confirmed: %s", r)
	}
	got = drain(t, conn, q)
	if len(got) != 1 || got[0].MessageId != "" || string(got[0].Body) != `{"from":"file"}` {
		t.Fatalf("from file: %d messages %+v", len(got), got)
	}

	// No --body: the body is stdin (here empty).
	mustRun(t, environ, "publish", "--queue", q, "--key", "k-stdin")
	if got = drain(t, conn, q); len(got) != 1 || got[0].MessageId != "k-stdin" || len(got[0].Body) != 0 {
		t.Fatalf("from stdin: %d messages %+v", len(got), got)
	}
}

// TestPublishFailsUnlessConfirmed: a copy that no queue takes (returned),
// or that the broker refuses (no such exchange), exits 1 and says so.
func TestPublishFailsUnlessConfirmed(t *testing.T) {
	t.Parallel()
	environ := env("idemq")
	r := idemq(t, environ, "publish", "--queue", testamqp.Name(t, "cli-pub-none"), "--key", "k", "--body", "b", "--copies", "3")
	if r.code != 1 || !strings.Contains(r.stdout, "0 confirmed, 3 returned unroutable") || !strings.Contains(r.stderr, "3 of 3 copies not confirmed") {
		t.Errorf("unroutable: want exit 1 and the count: %s", r)
	}
	r = idemq(t, environ, "publish", "--exchange", testamqp.Name(t, "cli-pub-nox"), "--key", "k", "--body", "b")
	if r.code != 1 || !strings.Contains(r.stderr, "NOT_FOUND") {
		t.Errorf("no such exchange: want exit 1 and the broker's reason: %s", r)
	}
}

func TestPublishBadUsage(t *testing.T) {
	t.Parallel()
	environ := env("idemq")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--body", "b"}, `"key" not set`},
		{[]string{"--key", "k", "--body", "b"}, "give --queue Q"},
		{[]string{"--queue", "q", "--exchange", "x", "--key", "k", "--body", "b"}, "either --queue or --exchange"},
		{[]string{"--queue", "q", "--key", "k", "--body", "b", "--copies", "0"}, "--copies 0"},
		{[]string{"--queue", "q", "--key", "k", "--body", "b", "--concurrency", "0"}, "--concurrency 0"},
		{[]string{"--queue", "q", "--key", "k", "--body", "b", "--header", "novalue"}, "name=value"},
		{[]string{"--queue", "q", "--key", "k", "--body", "@/nonexistent/file"}, "/nonexistent/file"},
	} {
		r := idemq(t, environ, append([]string{"publish"}, tc.args...)...)
		if r.code != 2 || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("%v: want exit 2 with %q: %s", tc.args, tc.want, r)
		}
	}
}
