package ui_test

import (
	"context"
	"net/url"
	"testing"

	"github.com/idemq/idemq/dedup"
)

// The key page says where the key's message is now — waiting in a retry
// tier, a dead letter in the DLQ (with its reason), done — and which
// replays moved it.
func TestKeyPageSaysWhereItIs(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := context.Background()
	release := func(key, reason string, attempts int) {
		t.Helper()
		fp, _ := dedup.BodyFingerprint([]byte(key))
		r, err := e.store.Reserve(ctx, dedup.Claim{Scope: dedup.Scope{Consumer: consumerName, Key: key}, Fingerprint: fp})
		if err != nil || r.Decision != dedup.Acquired {
			t.Fatalf("reserve %s: %v %v", key, r.Decision, err)
		}
		if err := e.store.Release(ctx, r.Lease, reason); err != nil {
			t.Fatal(err)
		}
		if _, err := e.pool.Exec(ctx, `UPDATE `+e.schema+`.keys SET attempts = $1 WHERE key = $2`, attempts, key); err != nil {
			t.Fatal(err)
		}
	}
	lookup := func(key string) page {
		t.Helper()
		return e.post("/keys", url.Values{"consumer": {consumerName}, "key": {key}})
	}

	release("order-retrying", string(dedup.OutcomeRetried), 2)
	mustContain(t, lookup("order-retrying"), `<li class="where-retry">`,
		"waiting in a retry tier of "+e.topo.Queue+" ("+e.topo.TierFor(2)+", after attempt 2)", `id="no-replays"`)

	release("order-failed", "permanent_error", 1)
	e.deadLetter("order-failed", "permanent_error", "card declined", []byte(`{}`))
	e.deadLetter("order-other", "permanent_error", "card declined", []byte(`{}`))
	e.waitReady(e.topo.DLQ, 2)
	p := lookup("order-failed")
	mustContain(t, p, `<li class="where-dlq"><a href="/dlq/letter?queue=`+url.QueryEscape(e.topo.Queue)+`&amp;id=`,
		"a dead letter in "+e.topo.DLQ+": reason permanent_error")
	id := field(t, letterID, e.get("/dlq?queue="+url.QueryEscape(e.topo.Queue)).body)

	// Replayed: the page says by whom, and the letter is gone from the DLQ.
	p = e.post("/dlq/replay/confirm", url.Values{"queue": {e.topo.Queue}, "id": {id}})
	p = e.post("/dlq/replay", url.Values{"queue": {e.topo.Queue}, "id": {id}, "once": {field(t, onceInput, p.body)}})
	waitJob(t, e, p.location, `replayed <b id="replayed">1</b>`)
	e.waitReady(e.topo.DLQ, 1)
	p = lookup("order-failed")
	mustContain(t, p, `<table id="replays">`, "<td>ui</td><td>"+e.topo.Queue+"</td><td>1 chosen dead letter(s)</td>", "no dead letter with this key is in the DLQs read")
	mustNotContain(t, p, `where-dlq`)
	if !isReplayedOnlyOnce(p.body) {
		t.Errorf("the other key's replay history leaks into this one:\n%s", p.body)
	}

	e.complete("order-done", dedup.Result{Outcome: dedup.OutcomeOK, Code: 200})
	mustContain(t, lookup("order-done"), `<li class="where-done">done: completed `, `id="no-replays"`)
	mustContain(t, lookup("order-other"), `<li class="where-dlq">`, `id="no-replays"`)
}

func isReplayedOnlyOnce(body string) bool {
	n := 0
	for i := 0; i+len("1 chosen dead letter(s)") <= len(body); i++ {
		if body[i:i+len("1 chosen dead letter(s)")] == "1 chosen dead letter(s)" {
			n++
		}
	}
	return n == 1
}
