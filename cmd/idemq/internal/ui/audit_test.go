package ui_test

import (
	"context"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"github.com/idemq/idemq/cmd/idemq/internal/audit"
	"github.com/idemq/idemq/cmd/idemq/internal/ui"
)

// A replay and an unpark are recorded under the name of the token the
// operator logged in with, with how many they moved and their result, and
// the Audit page lists them, the newest first.
func TestChangesAreAudited(t *testing.T) {
	t.Parallel()
	const alice = "alice-token-0123456789"
	e := newEnv(t, func(c *ui.Config) {
		c.Tokens = []ui.Token{{Name: "alice", Secret: alice}, {Name: "bob", Secret: "bob-token-0123456789ab"}}
	})
	csrf := field(t, csrfInput, e.get("/login").body)
	if p := e.post("/login", url.Values{"csrf": {csrf}, "token": {alice}, "next": {"/"}}); p.code != http.StatusSeeOther {
		t.Fatalf("login: %d\n%s", p.code, p.body)
	}
	e.deadLetter("order-1", "permanent_error", "card declined", []byte(`{}`))
	e.waitReady(e.topo.DLQ, 1)
	p := e.post("/dlq/replay/confirm", url.Values{"queue": {e.topo.Queue}, "reason": {"permanent_error"}})
	p = e.post("/dlq/replay", url.Values{"queue": {e.topo.Queue}, "reason": {"permanent_error"}, "count": {"1"}, "once": {field(t, onceInput, p.body)}})
	waitJob(t, e, p.location, `replayed <b id="replayed">1</b>`)

	enqueue(t, e, "out-1")
	if _, err := e.pool.Exec(context.Background(), `UPDATE `+e.schema+`.outbox SET parked_at = now(), parked_reason = 'unroutable: 312 NO_ROUTE'`); err != nil {
		t.Fatal(err)
	}
	p = e.post("/outbox/unpark/confirm", url.Values{"all": {"1"}})
	var ids []string
	for _, m := range regexp.MustCompile(`name="id" value="([0-9]+)"`).FindAllStringSubmatch(p.body, -1) {
		ids = append(ids, m[1])
	}
	p = e.post("/outbox/unpark", url.Values{"id": ids, "once": {field(t, onceInput, p.body)}})
	if p.code != http.StatusSeeOther {
		t.Fatalf("unpark: %d\n%s", p.code, p.body)
	}

	entries, err := audit.New(e.pool, e.schema).List(context.Background(), audit.Filter{})
	if err != nil || len(entries) != 2 {
		t.Fatalf("audit: %+v %v", entries, err)
	}
	unpark, replay := entries[0], entries[1]
	if unpark.Action.Action != audit.ActionUnpark || unpark.Actor != "alice" || unpark.Via != "ui" || unpark.Count != 1 || unpark.Result != "ok" {
		t.Errorf("unpark entry: %+v", unpark)
	}
	if replay.Action.Action != audit.ActionReplay || replay.Actor != "alice" || replay.Target != e.topo.Queue || replay.Count != 1 || replay.Result != "ok" ||
		!strings.Contains(replay.What, "reason permanent_error") {
		t.Errorf("replay entry: %+v", replay)
	}
	if byKey, err := audit.New(e.pool, e.schema).List(context.Background(), audit.Filter{KeyDigest: audit.KeyDigest("order-1")}); err != nil || len(byKey) != 1 {
		t.Errorf("the replayed key's entries: %+v %v", byKey, err)
	}

	p = e.get("/audit")
	mustContain(t, p, `<tr data-action="outbox.unpark" data-result="ok">`, `<tr data-action="dlq.replay" data-result="ok">`,
		"<td>alice</td><td>ui</td><td>dlq.replay</td><td>"+e.topo.Queue+"</td>")
	mustNotContain(t, p, "order-1", alice)
	if strings.Index(p.body, "outbox.unpark") > strings.Index(p.body, `data-action="dlq.replay"`) {
		t.Error("the newest entry is not first")
	}
}

// Without migration 012 a replay is refused before anything moves: what
// cannot be recorded is not done.
func TestUnrecordableReplayIsRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	if _, err := e.pool.Exec(context.Background(), `DROP TABLE `+e.schema+`.audit CASCADE`); err != nil {
		t.Fatal(err)
	}
	e.deadLetter("order-1", "permanent_error", "card declined", []byte(`{}`))
	e.waitReady(e.topo.DLQ, 1)
	p := e.post("/dlq/replay/confirm", url.Values{"queue": {e.topo.Queue}, "reason": {"permanent_error"}})
	p = e.post("/dlq/replay", url.Values{"queue": {e.topo.Queue}, "reason": {"permanent_error"}, "count": {"1"}, "once": {field(t, onceInput, p.body)}})
	if p.code != http.StatusServiceUnavailable || !strings.Contains(p.body, "idemq migrate") {
		t.Fatalf("replay without the audit table: %d\n%s", p.code, p.body)
	}
	e.waitReady(e.topo.DLQ, 1)
	mustContain(t, e.get("/audit"), "the store has no audit table")
}
