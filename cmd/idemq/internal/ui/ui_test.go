package ui_test

import (
	"context"
	"errors"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/cmd/idemq/internal/ui"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/outbox"
)

func TestOverview(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.complete("order-1", dedup.Result{Outcome: dedup.OutcomeOK, Code: 200})
	e.complete("order-2", dedup.Result{Outcome: dedup.OutcomeRejected, Code: 402, Reason: "insufficient funds"})
	fp, _ := dedup.BodyFingerprint([]byte("x"))
	if _, err := e.store.Reserve(context.Background(), dedup.Claim{Scope: dedup.Scope{Consumer: consumerName, Key: "order-3"}, Fingerprint: fp}); err != nil {
		t.Fatal(err)
	}
	e.deadLetter("order-4", "permanent_error", "card declined", []byte(`{}`))
	e.deadLetter("order-5", "permanent_error", "card declined", []byte(`{}`))
	e.deadLetter("order-6", "idempotency_key_reuse", "other body", []byte(`{}`))
	testamqpPublishWork(t, e, "order-7")
	enqueue(t, e, "out-1")
	e.waitReady(e.topo.DLQ, 3)

	p := e.get("/")
	if p.code != http.StatusOK {
		t.Fatalf("overview: %d\n%s", p.code, p.body)
	}
	mustContain(t, p,
		`<meta http-equiv="refresh" content="10">`,
		// payments: 1 completed (1h, 24h), 1 rejected, 1 in progress, 3 rows.
		`<td><a href="/keys?consumer=payments">payments</a></td><td class="n">1</td><td class="n">1</td>`+"\n"+`<td class="n">1</td><td class="n">1</td><td class="n">1</td>`,
		// Ready with no consumer: marked, and flagged.
		`<td>`+e.topo.Queue+` (work)</td><td class="n warn">1</td><td class="n">0</td>`,
		`<b>Look here first.</b> <span class="sev">critical</span> `+e.topo.Queue+` has 1 message(s) ready and no consumer`,
		e.topo.TierName(e.topo.Delays[0])+` (retry after 1s)</td><td class="n">0</td>`,
		`(dead letters)</td><td class="n">3</td>`,
		`permanent_error <b>2</b>`, `idempotency_key_reuse <b>1</b>`,
		`<tbody><tr><td class="n">1</td>`, // outbox pending
	)
	mustNotContain(t, p, "order-4", "postgres://", "amqp://")
}

func testamqpPublishWork(t *testing.T, e *env, key string) {
	t.Helper()
	if err := e.ch.PublishWithContext(context.Background(), "", e.topo.Queue, false, false, amqp.Publishing{MessageId: key, Body: []byte("{}")}); err != nil {
		t.Fatal(err)
	}
	e.waitReady(e.topo.Queue, 1)
}

func enqueue(t *testing.T, e *env, ids ...string) {
	t.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		for _, id := range ids {
			if err := e.outbox.Enqueue(ctx, tx, outbox.Message{Exchange: "ledger", RoutingKey: "entry", MessageID: id, Body: []byte("{}")}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

var letterID = regexp.MustCompile(`data-id="([0-9a-f]{16})" data-reason="permanent_error"`)

func TestDeadLettersListShowAndReplay(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.deadLetter("order-41", "permanent_error", "card declined", []byte(`{"amount":100}`))
	e.deadLetter("order-42", "permanent_error", "card declined", []byte{0x00, 0xff, 0x10})
	e.deadLetter("order-43", "idempotency_key_reuse", "other body", []byte(`{}`))
	e.waitReady(e.topo.DLQ, 3)
	q := url.QueryEscape(e.topo.Queue)

	p := e.get("/dlq?queue=" + q)
	wantHash := dedup.Scope{Consumer: consumerName, Key: "order-41"}.KeyHash()
	mustContain(t, p, "3 dead letters", wantHash, "card declined", "payments-in / card.charge", "Replay all 2…")
	mustNotContain(t, p, "order-41", "order-42")
	// The DLQ is only read: every letter is still there.
	e.waitReady(e.topo.DLQ, 3)

	// One letter's headers and body.
	id := field(t, letterID, p.body)
	p = e.get("/dlq/letter?queue=" + q + "&id=" + id)
	mustContain(t, p, "x-idemq-reason", "permanent_error", `{&#34;amount&#34;:100}`, "key hash "+wantHash)
	mustNotContain(t, p, "order-41")
	second := letterID.FindAllStringSubmatch(e.get("/dlq?queue="+q).body, -1)[1][1]
	mustContain(t, e.get("/dlq/letter?queue="+q+"&id="+second), "not text: hex", "00 ff 10")

	// Replay one: a confirmation page first, then the replay as a job.
	p = e.post("/dlq/replay/confirm", url.Values{"queue": {e.topo.Queue}, "id": {id}})
	mustContain(t, p, "Replay 1 chosen dead letter", wantHash)
	e.waitReady(e.topo.DLQ, 3) // confirming moved nothing
	once := field(t, onceInput, p.body)
	form := url.Values{"queue": {e.topo.Queue}, "id": {id}, "once": {once}}
	p = e.post("/dlq/replay", form)
	if p.code != http.StatusSeeOther || !strings.HasPrefix(p.location, "/jobs?id=") {
		t.Fatalf("replay: %d %q\n%s", p.code, p.location, p.body)
	}
	waitJob(t, e, p.location, "replayed <b id=\"replayed\">1</b>")
	e.waitReady(e.topo.Queue, 1)
	e.waitReady(e.topo.DLQ, 2)

	// The same form again (a reload, a double click) replays nothing.
	p = e.post("/dlq/replay", form)
	if p.code != http.StatusConflict || !strings.Contains(p.body, "already submitted") {
		t.Fatalf("second replay: %d\n%s", p.code, p.body)
	}
	// A new confirmation for the letter already replayed finds nothing.
	p = e.post("/dlq/replay/confirm", url.Values{"queue": {e.topo.Queue}, "id": {id}})
	if p.code != http.StatusConflict {
		t.Fatalf("confirm a replayed letter: %d\n%s", p.code, p.body)
	}
	e.waitReady(e.topo.Queue, 1)

	// All of one reason.
	p = e.post("/dlq/replay/confirm", url.Values{"queue": {e.topo.Queue}, "reason": {"permanent_error"}})
	mustContain(t, p, "Replay all 1 dead letters with reason <b>permanent_error</b>")
	p = e.post("/dlq/replay", url.Values{"queue": {e.topo.Queue}, "reason": {"permanent_error"}, "count": {"1"}, "once": {field(t, onceInput, p.body)}})
	waitJob(t, e, p.location, "replayed <b id=\"replayed\">1</b>, skipped <b id=\"skipped\">0</b>")
	e.waitReady(e.topo.Queue, 2)
	e.waitReady(e.topo.DLQ, 1)
	mustContain(t, e.get("/dlq?queue="+q), "idempotency_key_reuse", "1 dead letters")

	// A queue the UI was not started with is not served.
	if p := e.get("/dlq?queue=other"); p.code != http.StatusNotFound {
		t.Fatalf("unknown queue: %d", p.code)
	}
}

// waitJob polls a replay's page until it is done and holds want.
func waitJob(t *testing.T, e *env, path, want string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		p := e.get(path)
		if strings.Contains(p.body, `data-done="true"`) {
			mustContain(t, p, "Done.", want)
			mustNotContain(t, p, `http-equiv="refresh"`)
			return
		}
		mustContain(t, p, `<meta http-equiv="refresh" content="1">`, "<progress")
		if time.Now().After(deadline) {
			t.Fatalf("job not done:\n%s", p.body)
		}
		<-time.After(50 * time.Millisecond) // poll interval
	}
}

func TestKeyLookup(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *ui.Config) { c.JaegerURL = "http://jaeger.example:16686" })
	e.complete("order-7", dedup.Result{Outcome: dedup.OutcomeRejected, Code: 402, Reason: "insufficient funds", Response: []byte(`{"status":"declined"}`)})

	p := e.post("/keys", url.Values{"consumer": {consumerName}, "key": {"order-7"}})
	if p.code != http.StatusOK {
		t.Fatalf("lookup: %d\n%s", p.code, p.body)
	}
	mustContain(t, p,
		`<b>completed</b>`, "rejected: insufficient funds", "<th>attempts</th><td>1</td>",
		dedup.Scope{Consumer: consumerName, Key: "order-7"}.KeyHash(),
		`{&#34;status&#34;:&#34;declined&#34;}`, "code 402",
		`href="http://jaeger.example:16686/trace/4bf92f3577b34da6a3ce929d0e0e4736"`,
		`name="key" value="order-7"`, // where the operator typed it
	)
	// An in-progress key, its lease and recovery point.
	fp, _ := dedup.BodyFingerprint([]byte("x"))
	r, err := e.store.Reserve(context.Background(), dedup.Claim{Scope: dedup.Scope{Consumer: consumerName, Tenant: "acme", Key: "order-8"}, Fingerprint: fp})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.store.Step(context.Background(), r.Lease, "charged", func(context.Context, pgx.Tx) error { return nil }); err != nil {
		t.Fatal(err)
	}
	p = e.get("/keys?consumer=payments&tenant=acme&key=order-8")
	mustContain(t, p, "<b>in_progress</b>", "valid, locked until", "<td>charged</td>", "<td>acme</td>")

	// The overview's link fills the consumer in, and looks nothing up.
	p = e.get("/keys?consumer=payments")
	mustContain(t, p, `name="consumer" value="payments"`)
	mustNotContain(t, p, `class="error"`)

	p = e.post("/keys", url.Values{"consumer": {consumerName}, "key": {"absent"}})
	if p.code != http.StatusNotFound || !strings.Contains(p.body, "key not found") {
		t.Fatalf("absent key: %d\n%s", p.code, p.body)
	}
	if p := e.post("/keys", url.Values{"consumer": {consumerName}, "key": {"bad\x01key"}}); p.code != http.StatusBadRequest {
		t.Fatalf("invalid key: %d", p.code)
	}
}

func TestOutboxUnpark(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	enqueue(t, e, "out-1", "out-2", "out-3")
	if _, err := e.pool.Exec(context.Background(), `UPDATE `+e.schema+`.outbox SET parked_at = now(),
parked_reason = 'unroutable: 312 NO_ROUTE', returns = 5 WHERE message_id IN ('out-2', 'out-3')`); err != nil {
		t.Fatal(err)
	}
	p := e.get("/outbox")
	mustContain(t, p, "1 pending", "2 parked", "unroutable: 312 NO_ROUTE", "ledger / entry", "Unpark all 2…")
	mustNotContain(t, p, "out-1", "out-2")

	var ids []string
	for _, m := range regexp.MustCompile(`<tr data-id="(\d+)">`).FindAllStringSubmatch(p.body, -1) {
		ids = append(ids, m[1])
	}
	if len(ids) != 2 {
		t.Fatalf("parked rows: %v", ids)
	}
	// One.
	p = e.post("/outbox/unpark/confirm", url.Values{"id": {ids[0]}})
	mustContain(t, p, "Unpark 1 outbox row?")
	form := url.Values{"id": {ids[0]}, "once": {field(t, onceInput, p.body)}}
	if p = e.post("/outbox/unpark", form); p.code != http.StatusSeeOther || p.location != "/outbox?unparked=1" {
		t.Fatalf("unpark: %d %q\n%s", p.code, p.location, p.body)
	}
	mustContain(t, e.get(p.location), "Unparked 1 row(s)", "2 pending", "1 parked")
	if p = e.post("/outbox/unpark", form); p.code != http.StatusConflict {
		t.Fatalf("second unpark: %d", p.code)
	}
	// All.
	p = e.post("/outbox/unpark/confirm", url.Values{"all": {"1"}})
	mustContain(t, p, "Unpark 1 outbox row?")
	p = e.post("/outbox/unpark", url.Values{"id": {ids[1]}, "once": {field(t, onceInput, p.body)}})
	mustContain(t, e.get(p.location), "3 pending", "0 parked")
}

func TestCheckListen(t *testing.T) {
	for addr, ok := range map[string]bool{
		"127.0.0.1:8089": true, "[::1]:8089": true, "localhost:8089": true, "127.0.0.2:0": true,
		"0.0.0.0:8089": false, ":8089": false, "[::]:8089": false, "10.0.0.5:8089": false, "example.com:8089": false,
	} {
		err := ui.CheckListen(addr, false)
		if (err == nil) != ok || (err != nil && !errors.Is(err, ui.ErrNotLoopback)) {
			t.Errorf("CheckListen(%q, no token) = %v", addr, err)
		}
		if err := ui.CheckListen(addr, true); err != nil {
			t.Errorf("CheckListen(%q, token) = %v", addr, err)
		}
	}
	if err := ui.CheckListen("nonsense", true); err == nil {
		t.Error("CheckListen(nonsense): want an error")
	}
}

const token = "s3cret-token-0123456789"

func TestTokenRequired(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *ui.Config) { c.Token = token })
	for _, path := range []string{"/", "/dlq?queue=" + url.QueryEscape(e.topo.Queue), "/keys", "/outbox", "/jobs?id=x"} {
		if p := e.get(path); p.code != http.StatusSeeOther || !strings.HasPrefix(p.location, "/login?next=") {
			t.Fatalf("GET %s without the token: %d %q", path, p.code, p.location)
		}
	}
	// A POST without the token is refused before anything else.
	if p := e.postRaw("/outbox/unpark", url.Values{"id": {"1"}}, nil); p.code != http.StatusUnauthorized {
		t.Fatalf("POST without the token: %d", p.code)
	}
	bearer := func(tok string) page {
		req, _ := http.NewRequest(http.MethodGet, e.srv.URL+"/", nil)
		req.Header.Set("Authorization", "Bearer "+tok)
		return e.do(req)
	}
	if p := bearer("wrong"); p.code != http.StatusUnauthorized {
		t.Fatalf("wrong bearer: %d", p.code)
	}
	if p := bearer(token); p.code != http.StatusOK {
		t.Fatalf("bearer: %d", p.code)
	}
	// The login form sets a session cookie.
	p := e.get("/login?next=/outbox")
	csrf := field(t, csrfInput, p.body)
	mustNotContain(t, p, token)
	if p := e.post("/login", url.Values{"csrf": {csrf}, "token": {"wrong"}, "next": {"/outbox"}}); p.code != http.StatusUnauthorized {
		t.Fatalf("wrong login: %d", p.code)
	}
	if p := e.post("/login", url.Values{"csrf": {csrf}, "token": {token}, "next": {"//evil.example/"}}); p.code != http.StatusSeeOther || p.location != "/" {
		t.Fatalf("login to another site: %d %q", p.code, p.location)
	}
	if p := e.get("/outbox"); p.code != http.StatusOK {
		t.Fatalf("with the session: %d", p.code)
	}
	for _, c := range e.client.Jar.Cookies(mustURL(t, e.srv.URL)) {
		if strings.Contains(c.Value, token) {
			t.Fatalf("the cookie %s holds the token", c.Name)
		}
	}
	if p := e.post("/logout", url.Values{}); p.code != http.StatusSeeOther {
		t.Fatalf("logout: %d", p.code)
	}
	if p := e.get("/"); p.code != http.StatusSeeOther {
		t.Fatalf("after logout: %d", p.code)
	}
}

func mustURL(t *testing.T, s string) *url.URL {
	u, err := url.Parse(s)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

func TestPostsNeedCSRF(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	enqueue(t, e, "out-1")
	if _, err := e.pool.Exec(context.Background(), `UPDATE `+e.schema+`.outbox SET parked_at = now(), parked_reason = 'x'`); err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{"/dlq/replay/confirm", "/dlq/replay", "/outbox/unpark/confirm", "/outbox/unpark", "/keys", "/logout"} {
		// No token, and a token that is not the cookie's.
		for _, tok := range []string{"", strings.Repeat("ab", 32)} {
			p := e.postRaw(path, url.Values{"csrf": {tok}, "queue": {e.topo.Queue}, "all": {"1"}}, nil)
			if p.code != http.StatusForbidden || !strings.Contains(p.body, "CSRF") {
				t.Fatalf("POST %s with CSRF token %q: %d\n%s", path, tok, p.code, p.body)
			}
		}
	}
	// A cross-site POST is refused even with a valid token.
	p := e.postRaw("/outbox/unpark/confirm", url.Values{"csrf": {e.csrf()}, "all": {"1"}}, http.Header{"Sec-Fetch-Site": {"cross-site"}})
	if p.code != http.StatusForbidden {
		t.Fatalf("cross-site POST: %d", p.code)
	}
	// A GET changes nothing.
	if p := e.get("/outbox/unpark?all=1"); p.code != http.StatusMethodNotAllowed {
		t.Fatalf("GET unpark: %d", p.code)
	}
	if b, err := e.outbox.Pending(context.Background()); err != nil || b.Parked != 1 {
		t.Fatalf("backlog: %+v %v", b, err)
	}
}

func TestReadOnly(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *ui.Config) { c.ReadOnly = true })
	e.deadLetter("order-9", "permanent_error", "card declined", []byte(`{}`))
	e.waitReady(e.topo.DLQ, 1)
	p := e.get("/dlq?queue=" + url.QueryEscape(e.topo.Queue))
	mustContain(t, p, "read-only", "card declined")
	mustNotContain(t, p, "/dlq/replay", "Replay all", `type="checkbox"`)
	id := field(t, regexp.MustCompile(`data-id="([0-9a-f]{16})"`), p.body)
	for _, path := range []string{"/dlq/replay/confirm", "/dlq/replay", "/outbox/unpark/confirm", "/outbox/unpark"} {
		p := e.post(path, url.Values{"queue": {e.topo.Queue}, "id": {id}, "reason": {"permanent_error"}, "count": {"1"}})
		if p.code != http.StatusForbidden || !strings.Contains(p.body, "read-only") {
			t.Fatalf("POST %s read-only: %d\n%s", path, p.code, p.body)
		}
	}
	e.waitReady(e.topo.DLQ, 1)
	// Looking a key up is no change.
	if p := e.post("/keys", url.Values{"consumer": {consumerName}, "key": {"k"}}); p.code != http.StatusNotFound {
		t.Fatalf("lookup read-only: %d", p.code)
	}
}

func TestNoCredentialsRendered(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *ui.Config) {
		c.Dial = func() (*amqp.Connection, error) {
			return amqp.DialConfig("amqp://guest:pa55word@127.0.0.1:1/", amqp.Config{Dial: amqp.DefaultDial(time.Second)})
		}
	})
	for _, path := range []string{"/", "/dlq?queue=" + url.QueryEscape(e.topo.Queue)} {
		p := e.get(path)
		mustContain(t, p, "connection refused")
		mustNotContain(t, p, "pa55word", "guest:", "postgres://")
	}
	// A dial error that names the URL is redacted too.
	e2 := newEnv(t, func(c *ui.Config) {
		c.Dial = func() (*amqp.Connection, error) {
			return nil, errors.New("cannot reach amqp://guest:pa55word@broker:5672/: refused")
		}
	})
	p := e2.get("/")
	mustContain(t, p, "amqp://xxxxx@broker:5672/")
	mustNotContain(t, p, "pa55word")
}

func TestRawKeysOnlyWhenShown(t *testing.T) {
	t.Parallel()
	for _, show := range []bool{false, true} {
		e := newEnv(t, func(c *ui.Config) { c.ShowKeys = show })
		e.deadLetter("order-secret-1", "permanent_error", "card declined", []byte(`{}`))
		enqueue(t, e, "order-secret-2")
		e.waitReady(e.topo.DLQ, 1)
		q := url.QueryEscape(e.topo.Queue)
		list := e.get("/dlq?queue=" + q)
		id := field(t, letterID, list.body)
		pages := []page{
			list, e.get("/dlq/letter?queue=" + q + "&id=" + id), e.get("/outbox"), e.get("/"),
			e.post("/dlq/replay/confirm", url.Values{"queue": {e.topo.Queue}, "id": {id}}),
		}
		for i, p := range pages {
			has := strings.Contains(p.body, "order-secret-1") || strings.Contains(p.body, "order-secret-2")
			want := show && i != 3 // the overview lists no keys
			if has != want {
				t.Fatalf("show-keys %v, page %d: raw key shown %v:\n%s", show, i, has, p.body)
			}
		}
	}
}
