package main_test

import (
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/testamqp"
)

// TestTopologyDelete declares a work queue with the tiers of two retry
// policies and one tier of an odd delay, and deletes it: without --yes
// nothing goes; with --yes the queue, every tier found, the DLQ and the DLX
// go; the odd tier is found through the management API only.
func TestTopologyDelete(t *testing.T) {
	t.Parallel()
	q := testamqp.Name(t, "cli-topo-del")
	odd := q + ".retry.7s"
	tiers := []string{"500ms", "1s", "5s", "25s", "2m5s"}
	deleteTopologyAtCleanup(t, q, tiers, []string{odd}, nil)
	environ := env("idemq")
	mustRun(t, environ, "topology", "apply", "--queue", q, "--max-attempts", "3", "--retry-initial", "500ms", "--retry-multiplier", "2")
	mustRun(t, environ, "topology", "apply", "--queue", q) // the default policy's tiers too
	conn := testamqp.Dial(t)
	ch := testamqp.Channel(t, conn)
	if _, err := ch.QueueDeclare(odd, true, false, false, false, amqp.Table{"x-queue-type": "quorum", "x-message-ttl": int64(7000)}); err != nil {
		t.Fatal(err)
	}
	mustRun(t, environ, "publish", "--queue", q+".dlq", "--key", "k", "--body", "b", "--copies", "2")
	named := []string{q, q + ".dlq"} // found by name without the management API
	for _, d := range tiers {
		named = append(named, q+".retry."+d)
	}
	all := append(named[:len(named):len(named)], odd)

	// Without --yes: what would go, and nothing gone.
	r := idemq(t, environ, "topology", "delete", "--queue", q)
	if r.code != 2 || !strings.Contains(r.stderr, "--yes") {
		t.Fatalf("without --yes: want exit 2 and a pointer to --yes: %s", r)
	}
	for _, name := range named {
		if !strings.Contains(r.stdout, name+" ") {
			t.Errorf("would delete: %s not named:\n%s", name, r.stdout)
		}
	}
	if !regexp.MustCompile(regexp.QuoteMeta(q+".dlq")+` +dead-letter queue, 2 messages`).MatchString(r.stdout) || !strings.Contains(r.stdout, q+".dlx ") {
		t.Errorf("would delete: DLQ count or DLX missing:\n%s", r.stdout)
	}
	if strings.Contains(r.stdout, odd) {
		t.Errorf("the tier of an odd delay found without the management API:\n%s", r.stdout)
	}
	for _, name := range all {
		queueState(t, conn, name) // fails if gone
	}

	// The management API lists the vhost's queues (here a stand-in that
	// answers what RabbitMQ's would, checking the path and credentials).
	mgmt := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		user, pass, _ := req.BasicAuth()
		if req.URL.EscapedPath() != "/api/queues/%2F" || user != "guest" || pass != "guest" {
			http.Error(w, "unexpected request "+req.URL.String(), http.StatusNotFound)
			return
		}
		_ = json.NewEncoder(w).Encode([]map[string]string{{"name": q}, {"name": odd}, {"name": q + ".retry.x"}, {"name": "other.retry.7s"}})
	}))
	t.Cleanup(mgmt.Close)
	r = mustRun(t, environ, "topology", "delete", "--queue", q, "--management-url", mgmt.URL, "--yes")
	for _, name := range all {
		if !strings.Contains(r.stdout, "deleted queue "+name+" ") {
			t.Errorf("%s not deleted:\n%s", name, r.stdout)
		}
	}
	if !strings.Contains(r.stdout, "deleted queue "+q+".dlq (dead-letter queue, 2 messages)") || !strings.Contains(r.stdout, "deleted exchange "+q+".dlx") {
		t.Errorf("DLQ or DLX:\n%s", r.stdout)
	}
	for _, name := range all {
		if queueExists(t, conn, name) {
			t.Errorf("%s still exists", name)
		}
	}
	// Twice is safe.
	if r := mustRun(t, environ, "topology", "delete", "--queue", q, "--yes"); !strings.Contains(r.stdout, "nothing to delete") {
		t.Errorf("again: %s", r)
	}
}

// queueExists reports whether queue exists.
func queueExists(t *testing.T, conn *amqp.Connection, queue string) bool {
	t.Helper()
	ch := testamqp.Channel(t, conn)
	_, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	var ae *amqp.Error
	if errors.As(err, &ae) && ae.Code == amqp.NotFound {
		return false
	}
	if err != nil {
		t.Fatalf("inspect %s: %v", queue, err)
	}
	return true
}
