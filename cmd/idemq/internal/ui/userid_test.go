package ui_test

import (
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/testamqp"
)

// TestReplayOfAForeignUserID: a dead letter the broker made (x-death,
// delivery_limit) from a message a second broker user published keeps that
// user's user_id, which the UI's user (guest) may not publish. The
// confirmation page says so and offers to drop it; not ticked, the replay
// leaves the letter in the DLQ and its page says why; ticked, the letter
// moves without its user_id and the page counts it.
func TestReplayOfAForeignUserID(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	alice, aliceURL := testamqp.AddUser(t, "alice")
	death := amqp.Table{
		"count": int64(21), "reason": "delivery_limit", "queue": e.topo.Queue, "time": time.Now().Truncate(time.Second),
		"exchange": "", "routing-keys": []any{e.topo.Queue},
	}
	testamqp.Publish(t, testamqp.Channel(t, testamqp.DialURL(t, aliceURL)), "", e.topo.DLQ, amqp.Publishing{
		MessageId: "crash-9", UserId: alice, Body: []byte(`{}`),
		Headers: amqp.Table{
			"x-death": []any{death}, "x-first-death-reason": "delivery_limit",
			"x-first-death-queue": e.topo.Queue, "x-first-death-exchange": "",
		},
	})
	e.waitReady(e.topo.DLQ, 1)

	confirm := func() string {
		p := e.post("/dlq/replay/confirm", url.Values{"queue": {e.topo.Queue}, "reason": {"delivery_limit"}})
		mustContain(t, p, `id="foreign-user-id"`, `name="drop_user_id"`)
		return field(t, onceInput, p.body)
	}
	form := url.Values{"queue": {e.topo.Queue}, "reason": {"delivery_limit"}, "count": {"1"}, "once": {confirm()}}
	p := e.post("/dlq/replay", form)
	done := waitDone(t, e, p.location)
	mustContain(t, done, "Stopped:", `id="user-id-refused"`, "replayed <b id=\"replayed\">0</b>")
	mustNotContain(t, done, "crash-9")
	e.waitReady(e.topo.DLQ, 1)

	form.Set("once", confirm())
	form.Set("drop_user_id", "1")
	p = e.post("/dlq/replay", form)
	done = waitDone(t, e, p.location)
	mustContain(t, done, "Done.", `id="user-id-dropped"`, "replayed <b id=\"replayed\">1</b>")
	e.waitReady(e.topo.DLQ, 0)
	e.waitReady(e.topo.Queue, 1)
	d, ok, err := e.ch.Get(e.topo.Queue, true)
	if err != nil || !ok || d.MessageId != "crash-9" || d.UserId != "" {
		t.Fatalf("replayed copy: %v %v, message_id %q, user_id %q", ok, err, d.MessageId, d.UserId)
	}
}

// waitDone polls a replay's page until it is done, and returns it.
func waitDone(t *testing.T, e *env, path string) page {
	t.Helper()
	if !strings.HasPrefix(path, "/jobs?id=") {
		t.Fatalf("replay: sent to %q, not a job's page", path)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		p := e.get(path)
		if p.code != http.StatusOK {
			t.Fatalf("job page: %d\n%s", p.code, p.body)
		}
		if strings.Contains(p.body, `data-done="true"`) {
			return p
		}
		if time.Now().After(deadline) {
			t.Fatalf("job not done:\n%s", p.body)
		}
		<-time.After(50 * time.Millisecond) // poll interval
	}
}
