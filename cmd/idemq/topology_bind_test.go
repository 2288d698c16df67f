package main_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/testamqp"
)

// topology apply --bind binds the work queue to a topic exchange it
// declares, to an existing direct exchange, and to a headers exchange;
// what is published there reaches Q. A missing exchange without a kind is
// refused by the broker (exit 1); a malformed --bind is bad usage (exit 2).
func TestTopologyApplyBind(t *testing.T) {
	t.Parallel()
	q := testamqp.Name(t, "cli-bind")
	topic, direct, headers, missing := q+".orders", q+".direct", q+".events", q+".nowhere"
	deleteTopologyAtCleanup(t, q, []string{"1s", "5s", "25s", "2m5s"}, nil, []string{topic, direct, headers, missing})
	conn := testamqp.Dial(t)
	ch := testamqp.Channel(t, conn)
	if err := ch.ExchangeDeclare(direct, amqp.ExchangeDirect, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	environ := env("idemq")
	args := []string{"topology", "apply", "--queue", q,
		"--bind", topic + ":topic:order.*", "--bind", direct + ":payments", "--bind", headers + ":headers:x-match=all,type=refund"}
	r := mustRun(t, environ, args...)
	for _, want := range []string{`binding\s+` + topic + `:topic:order\.\*`, `binding\s+` + direct + `:payments`} {
		if !regexp.MustCompile(want).MatchString(r.stdout) {
			t.Errorf("output lacks %q:\n%s", want, r.stdout)
		}
	}
	mustRun(t, environ, args...) // idempotent
	testamqp.Publish(t, ch, topic, "order.created", amqp.Publishing{MessageId: "a"})
	testamqp.Publish(t, ch, topic, "invoice.sent", amqp.Publishing{MessageId: "not-bound"})
	testamqp.Publish(t, ch, direct, "payments", amqp.Publishing{MessageId: "b"})
	testamqp.Publish(t, ch, headers, "", amqp.Publishing{MessageId: "c", Headers: amqp.Table{"type": "refund"}})
	testamqp.Publish(t, ch, headers, "", amqp.Publishing{MessageId: "not-matched", Headers: amqp.Table{"type": "charge"}})
	var ids []string
	for _, d := range drain(t, conn, q) {
		ids = append(ids, d.MessageId)
	}
	if strings.Join(ids, ",") != "a,b,c" {
		t.Fatalf("Q holds %v, want a, b, c", ids)
	}

	r = idemq(t, environ, "topology", "apply", "--queue", q, "--bind", missing+":k")
	if r.code != 1 || !strings.Contains(r.stderr, "NOT_FOUND") || !strings.Contains(r.stderr, missing) {
		t.Errorf("binding to a missing exchange: want exit 1 with the broker's NOT_FOUND: %s", r)
	}
	for _, bad := range []string{"no-colon", ":topic:k", "x::k", "x:headers:novalue", q + ".dlx:k"} {
		if r := idemq(t, environ, "topology", "apply", "--queue", q, "--bind", bad); r.code != 2 || !strings.Contains(r.stderr, "--bind") {
			t.Errorf("--bind %q: want exit 2 naming --bind: %s", bad, r)
		}
	}
}

// writeTopology writes a topology file into a temporary directory.
func writeTopology(t *testing.T, text string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "topology.yaml")
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

const topologyFileText = `queues:
  - name: %[1]s.pay
    delivery_limit: %[2]d
    retry: {max_attempts: 3, initial: 500ms, multiplier: 2, max: 1m}
    bindings:
      - {exchange: %[1]s.orders, kind: topic, key: order.created, declare: true}
      - {exchange: %[1]s.orders, key: order.paid}
  - name: %[1]s.mail
    kind: classic
    retry: {max_attempts: 2, initial: 1s}
exchanges:
  - {name: %[1]s.out, kind: topic}
`

// topology apply -f declares every queue of a file, idempotently; topology
// diff -f exits 0 while the broker has it, and 1, naming the difference,
// when an argument changed or a queue, an exchange or a binding is missing.
func TestTopologyFileApplyAndDiff(t *testing.T) {
	t.Parallel()
	p := testamqp.Name(t, "cli-file")
	deleteTopologyAtCleanup(t, p+".pay", []string{"500ms", "1s"}, nil, []string{p + ".orders", p + ".out"})
	deleteTopologyAtCleanup(t, p+".mail", []string{"1s"}, nil, nil)
	environ := env("idemq")
	file := writeTopology(t, fmt.Sprintf(topologyFileText, p, 20))
	r := mustRun(t, environ, "topology", "apply", "-f", file)
	for _, name := range []string{p + ".pay ", p + ".pay.retry.500ms ", p + ".pay.retry.1s ", p + ".mail ", p + ".mail.retry.1s ", p + ".out ", p + ".orders:topic:order.created", p + ".orders:order.paid"} {
		if !strings.Contains(r.stdout, name) {
			t.Errorf("apply output does not name %q:\n%s", name, r.stdout)
		}
	}
	mustRun(t, environ, "topology", "apply", "-f", file) // idempotent
	conn := testamqp.Dial(t)
	ch := testamqp.Channel(t, conn)
	testamqp.Publish(t, ch, p+".orders", "order.paid", amqp.Publishing{MessageId: "x"})
	if n, _ := queueState(t, conn, p+".pay"); n != 1 {
		t.Fatalf("%s.pay holds %d messages after a publish to its bound exchange, want 1", p, n)
	}

	if r := mustRun(t, environ, "topology", "diff", "-f", file); !strings.Contains(r.stdout, "no differences") {
		t.Errorf("diff of what was applied: %s", r)
	}

	// A changed delivery limit, a changed queue kind.
	changed := strings.Replace(fmt.Sprintf(topologyFileText, p, 7), "kind: classic", "kind: quorum", 1)
	r = idemq(t, environ, "topology", "diff", "-f", writeTopology(t, changed))
	if r.code != 1 || !strings.Contains(r.stdout, "x-delivery-limit") || !strings.Contains(r.stdout, "x-queue-type") {
		t.Errorf("diff with another delivery limit and queue kind: want exit 1 naming both: %s", r)
	}
	for _, line := range strings.Split(strings.TrimSpace(r.stdout), "\n") {
		if strings.HasPrefix(line, "missing") {
			t.Errorf("a changed argument reported as missing: %s", line)
		}
	}

	// A queue (with its binding) and an exchange missing.
	more := strings.Replace(fmt.Sprintf(topologyFileText, p, 20), "exchanges:\n",
		fmt.Sprintf("  - {name: %[1]s.new, bindings: [{exchange: %[1]s.orders, key: new}]}\nexchanges:\n  - {name: %[1]s.ledger, kind: fanout}\n", p), 1)
	r = idemq(t, environ, "topology", "diff", "-f", writeTopology(t, more))
	for _, want := range []string{`missing\s+queue\s+` + p + `\.new\s`, `missing\s+exchange\s+` + p + `\.ledger`, `missing\s+binding\s+` + p + `\.new\s+` + p + `\.orders:new`} {
		if !regexp.MustCompile(want).MatchString(r.stdout) {
			t.Errorf("diff does not report %s:\n%s", want, r.stdout)
		}
	}
	if r.code != 1 {
		t.Errorf("diff with missing parts: want exit 1: %s", r)
	}
	if strings.Contains(r.stdout, "differs") {
		t.Errorf("what is missing reported as different: %s", r.stdout)
	}
	if n := queueExists(t, conn, p+".new"); n {
		t.Errorf("diff created %s.new", p)
	}

	// Bindings are read through the management API: one of them missing.
	mgmt := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		user, pass, _ := req.BasicAuth()
		want := "/api/queues/%2F/" + p + ".pay/bindings"
		switch {
		case user != "guest" || pass != "guest":
			http.Error(w, "unauthorised", http.StatusUnauthorized)
		case req.URL.EscapedPath() == want:
			_ = json.NewEncoder(w).Encode([]map[string]any{
				{"source": "", "destination": p + ".pay", "routing_key": p + ".pay", "arguments": map[string]any{}},
				{"source": p + ".orders", "destination": p + ".pay", "routing_key": "order.created", "arguments": map[string]any{}},
			})
		case strings.HasPrefix(req.URL.EscapedPath(), "/api/queues/%2F/") && strings.HasSuffix(req.URL.Path, "/bindings"):
			_ = json.NewEncoder(w).Encode([]map[string]any{})
		default:
			http.Error(w, "unexpected request "+req.URL.String(), http.StatusNotFound)
		}
	}))
	t.Cleanup(mgmt.Close)
	r = idemq(t, environ, "topology", "diff", "-f", file, "--management-url", mgmt.URL)
	if r.code != 1 || !strings.Contains(r.stdout, p+".orders:order.paid") || strings.Contains(r.stdout, "order.created") {
		t.Errorf("diff through the management API with a binding missing: want exit 1 naming only order.paid: %s", r)
	}

	// Bad files are bad usage.
	for _, bad := range []string{"queues: [{name: ''}]", "queues: [{name: a, kind: stream}]", "queues: [{name: a, colour: red}]", "queues: [{name: a}, {name: a}]", "exchanges: [{name: x}]"} {
		if r := idemq(t, environ, "topology", "diff", "-f", writeTopology(t, bad)); r.code != 2 {
			t.Errorf("file %q: want exit 2: %s", bad, r)
		}
	}
	if r := idemq(t, environ, "topology", "apply", "-f", file, "--queue", "q"); r.code != 2 {
		t.Errorf("-f with --queue: want exit 2: %s", r)
	}
	if r := idemq(t, environ, "topology", "apply"); r.code != 2 || !strings.Contains(r.stderr, "queue") {
		t.Errorf("neither -f nor --queue: want exit 2 naming --queue: %s", r)
	}
}
