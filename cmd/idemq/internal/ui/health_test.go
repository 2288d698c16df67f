package ui_test

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/cmd/idemq/internal/ui"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/testamqp"
)

// healthReport is /api/health's body.
type healthReport struct {
	Status string `json:"status"`
	Flags  []struct {
		Severity, Check, Subject, Problem, Action, Link string
	} `json:"flags"`
}

func (e *env) health(header http.Header) (int, healthReport) {
	e.t.Helper()
	req, err := http.NewRequest(http.MethodGet, e.srv.URL+"/api/health", nil)
	if err != nil {
		e.t.Fatal(err)
	}
	for k, v := range header {
		req.Header[k] = v
	}
	p := e.do(req)
	var h healthReport
	if err := json.Unmarshal([]byte(p.body), &h); err != nil {
		e.t.Fatalf("/api/health (%d): %v\n%s", p.code, err, p.body)
	}
	return p.code, h
}

// checks returns the flags' checks and subjects, as "check subject".
func (h healthReport) checks() []string {
	var out []string
	for _, f := range h.Flags {
		out = append(out, f.Check+" "+f.Subject)
	}
	return out
}

func (h healthReport) has(check, subject string) bool {
	for _, f := range h.Flags {
		if f.Check == check && f.Subject == subject {
			return true
		}
	}
	return false
}

// A system with nothing wrong says so, on the page and in /api/health.
func TestHealthNothingNeedsYou(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.complete("order-1", dedup.Result{Outcome: dedup.OutcomeOK, Code: 200})
	code, h := e.health(nil)
	if code != http.StatusOK || h.Status != "ok" || len(h.Flags) != 0 {
		t.Fatalf("/api/health: %d %+v, want 200 ok without flags", code, h)
	}
	p := e.get("/")
	mustContain(t, p, `<section class="card health ok" id="health"><h2>Nothing needs you.</h2>`)
	mustNotContain(t, p, "Look here first")
}

// Each check flags what it is about, the critical ones first; the page
// says where to look first and marks the rows; /api/health answers 503
// while one is critical. A flag goes when what it is about is fixed.
func TestHealthFlags(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *ui.Config) {
		c.Health = ui.HealthLimits{OutboxAge: time.Millisecond, Retrying: 1}
	})
	ctx := context.Background()
	// Before anything is wrong: the DLQ's depth is read (0).
	if code, h := e.health(nil); code != http.StatusOK || h.Status != "ok" {
		t.Fatalf("/api/health before: %d %+v", code, h)
	}

	// A key whose worker died: in progress, its lease expired.
	fp, _ := dedup.BodyFingerprint([]byte("x"))
	if _, err := e.store.Reserve(ctx, dedup.Claim{Scope: dedup.Scope{Consumer: consumerName, Key: "order-1"}, Fingerprint: fp}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(ctx, `UPDATE `+e.schema+`.keys SET locked_until = now() - interval '1 minute'`); err != nil {
		t.Fatal(err)
	}
	// A message ready with no consumer; two waiting in the longest retry
	// tier (whose TTL outlasts the test); a dead letter that came in.
	testamqpPublishWork(t, e, "order-2")
	tier := e.topo.TierName(e.topo.Delays[len(e.topo.Delays)-1])
	for _, id := range []string{"order-3", "order-4"} {
		testamqp.Publish(t, e.ch, "", tier, amqp.Publishing{MessageId: id, Body: []byte("{}")})
	}
	e.waitReady(tier, 2)
	e.deadLetter("order-5", "permanent_error", "card declined", []byte(`{}`))
	e.waitReady(e.topo.DLQ, 1)
	// An outbox row parked, one pending longer than OutboxAge.
	enqueue(t, e, "out-1", "out-2")
	if _, err := e.pool.Exec(ctx, `UPDATE `+e.schema+`.outbox SET parked_at = now(), parked_reason = 'unroutable: 312 NO_ROUTE' WHERE message_id = 'out-1'`); err != nil {
		t.Fatal(err)
	}

	code, h := e.health(nil)
	if code != http.StatusServiceUnavailable || h.Status != "critical" {
		t.Fatalf("/api/health: %d %s, want 503 critical; flags %q", code, h.Status, h.checks())
	}
	q := e.topo.Queue
	want := []string{"no_consumer " + q, "expired_leases " + consumerName, "retrying " + q, "dlq_grew " + e.topo.DLQ,
		"outbox_parked outbox", "outbox_behind outbox"}
	if got := strings.Join(h.checks(), ", "); got != strings.Join(want, ", ") {
		t.Fatalf("flags:\n got %s\nwant %s", got, strings.Join(want, ", "))
	}
	for _, f := range h.Flags {
		if f.Problem == "" || f.Action == "" || f.Link == "" {
			t.Errorf("flag %s %s says too little: %+v", f.Check, f.Subject, f)
		}
	}
	if f := h.Flags[0]; f.Severity != "critical" || !strings.Contains(f.Problem, "1 message(s) ready and no consumer") {
		t.Errorf("first flag: %+v", f)
	}
	if f := h.Flags[3]; !strings.Contains(f.Problem, "1 dead letter(s) came into "+e.topo.DLQ) || f.Link != "/dlq?queue="+q {
		t.Errorf("dlq flag: %+v", f)
	}

	p := e.get("/")
	mustContain(t, p,
		`<section class="card health critical" id="health">`, `6 thing(s) need you: messages are not moving`,
		`<b>Look here first.</b> <span class="sev">critical</span> `+q+` has 1 message(s) ready and no consumer`,
		`<td>`+q+` (work)</td><td class="n warn">1</td><td class="n">0</td>`,
		tier+` (retry after `, `<td class="n warn">2</td>`,
		`1 key(s) of consumer payments are in progress past their lease`,
		`1 outbox row(s) are parked`, `<a href="/outbox">the outbox</a>`,
	)
	mustNotContain(t, p, "Nothing needs you", "order-5")

	// A worker starts: the queue's flag goes, the rest stay.
	ch := testamqp.Channel(t, e.conn)
	if _, err := ch.Consume(q, "", false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		code, h = e.health(nil)
		if !h.has("no_consumer", q) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no_consumer still flagged with a consumer: %q", h.checks())
		}
		<-time.After(50 * time.Millisecond) // the broker counts the consumer
	}
	if code != http.StatusOK || h.Status != "warning" || len(h.Flags) != 5 {
		t.Fatalf("with a consumer: %d %s %q, want 200 warning and 5 flags", code, h.Status, h.checks())
	}
}

// A queue that does not exist is critical: what is sent to it is lost.
func TestHealthMissingQueue(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	if _, err := e.ch.QueueDelete(e.topo.DLQ, false, false, false); err != nil {
		t.Fatal(err)
	}
	code, h := e.health(nil)
	if code != http.StatusServiceUnavailable || !h.has("queue_missing", e.topo.DLQ) {
		t.Fatalf("/api/health: %d %q, want 503 with queue_missing %s", code, h.checks(), e.topo.DLQ)
	}
}

// /api/health is behind the UI's token: a script without it is refused
// with 401 (never sent to the login page), with it answered.
func TestHealthNeedsTheToken(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *ui.Config) { c.Token = token })
	p := e.get("/api/health")
	if p.code != http.StatusUnauthorized || p.location != "" || strings.Contains(p.body, `"status"`) {
		t.Fatalf("without the token: %d %q\n%s", p.code, p.location, p.body)
	}
	req, err := http.NewRequest(http.MethodGet, e.srv.URL+"/api/health", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer wrong-token-0123456789")
	if p := e.do(req); p.code != http.StatusUnauthorized {
		t.Fatalf("a wrong token: %d\n%s", p.code, p.body)
	}
	if code, h := e.health(http.Header{"Authorization": {"Bearer " + token}}); code != http.StatusOK || h.Status != "ok" {
		t.Fatalf("with the token: %d %+v", code, h)
	}
}
