package ui_test

import (
	"net/url"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/wire"
)

// Letters whose reason cannot succeed unchanged are not offered for a
// replay of their reason; chosen anyway, the confirmation page says what
// will happen, and they are replayed only when its box is ticked.
func TestReplayOfDoomedLettersNeedsTheBox(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.deadLetter("order-1", "idempotency_key_reuse", "other body", []byte(`{}`))
	e.deadLetter("order-2", "idempotency_key_reuse", "other body", []byte(`{}`))
	e.deadLetter("order-3", "permanent_error", "card declined", []byte(`{}`))
	e.waitReady(e.topo.DLQ, 3)
	q := url.QueryEscape(e.topo.Queue)

	p := e.get("/dlq?queue=" + q)
	mustContain(t, p, "Replay all 1…", "Not offered: its key was first used for another operation", "Replay them anyway…", "comes straight back")
	mustNotContain(t, p, "Replay all 2…")

	p = e.post("/dlq/replay/confirm", url.Values{"queue": {e.topo.Queue}, "reason": {"idempotency_key_reuse"}})
	mustContain(t, p, `id="doomed"`, "<b>2</b> of them cannot succeed unchanged", `name="doomed" value="1"`, "Unless ticked, they stay in the DLQ")
	once := field(t, onceInput, p.body)
	p = e.post("/dlq/replay", url.Values{"queue": {e.topo.Queue}, "reason": {"idempotency_key_reuse"}, "count": {"2"}, "once": {once}})
	waitJob(t, e, p.location, `replayed <b id="replayed">0</b>`)
	mustContain(t, e.get(p.location), `<b>2</b> left in the DLQ: their reason cannot succeed unchanged`)
	e.waitReady(e.topo.DLQ, 3)

	p = e.post("/dlq/replay/confirm", url.Values{"queue": {e.topo.Queue}, "reason": {"idempotency_key_reuse"}})
	once = field(t, onceInput, p.body)
	p = e.post("/dlq/replay", url.Values{"queue": {e.topo.Queue}, "reason": {"idempotency_key_reuse"}, "count": {"2"}, "once": {once}, "doomed": {"1"}})
	waitJob(t, e, p.location, `replayed <b id="replayed">2</b>`)
	e.waitReady(e.topo.Queue, 2)
	e.waitReady(e.topo.DLQ, 1)
}

// A letter older than the key retention is marked in the list and on the
// confirmation page, and replayed only when its box is ticked.
func TestReplayOfOldLettersNeedsTheBox(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	old := wire.DeadLetterHeaders("permanent_error", nil, 1)
	old[wire.HeaderFirstSeen] = time.Now().Add(-48 * time.Hour).UTC().Format(time.RFC3339Nano)
	testamqp.Publish(t, e.ch, "", e.topo.DLQ, amqp.Publishing{MessageId: "order-old", Body: []byte(`{}`), Headers: old})
	e.deadLetter("order-new", "permanent_error", "card declined", []byte(`{}`))
	e.waitReady(e.topo.DLQ, 2)
	q := url.QueryEscape(e.topo.Queue)

	p := e.get("/dlq?queue=" + q)
	mustContain(t, p, "Replay all 2…", "older than the key retention (24h0m0s)")
	p = e.post("/dlq/replay/confirm", url.Values{"queue": {e.topo.Queue}, "reason": {"permanent_error"}})
	mustContain(t, p, `id="older"`, "<b>1</b> of them are older than the key retention (24h0m0s): its key may be gone: it would run again",
		`name="older" value="1"`)
	mustNotContain(t, p, `id="doomed"`)
	once := field(t, onceInput, p.body)
	p = e.post("/dlq/replay", url.Values{"queue": {e.topo.Queue}, "reason": {"permanent_error"}, "count": {"2"}, "once": {once}})
	waitJob(t, e, p.location, `replayed <b id="replayed">1</b>`)
	mustContain(t, e.get(p.location), `<b>1</b> left in the DLQ: older than the key retention`)
	e.waitReady(e.topo.Queue, 1)
	e.waitReady(e.topo.DLQ, 1)

	p = e.post("/dlq/replay/confirm", url.Values{"queue": {e.topo.Queue}, "reason": {"permanent_error"}})
	once = field(t, onceInput, p.body)
	p = e.post("/dlq/replay", url.Values{"queue": {e.topo.Queue}, "reason": {"permanent_error"}, "count": {"1"}, "once": {once}, "older": {"1"}})
	waitJob(t, e, p.location, `replayed <b id="replayed">1</b>`)
	e.waitReady(e.topo.Queue, 2)
	e.waitReady(e.topo.DLQ, 0)
}
