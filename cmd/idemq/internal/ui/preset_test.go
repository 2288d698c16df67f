package ui_test

import (
	"net/url"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/cmd/idemq/internal/ui"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/wire"
)

// With the consumers' key preset, a dead letter's key is read as they read
// it: a structured CloudEvent's is its source and id, not its message_id;
// its page and the key page find it under that key.
func TestDeadLettersUnderTheKeyPreset(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *ui.Config) { c.KeyFrom = consumer.KeyFromCloudEvents })
	h := wire.DeadLetterHeaders("permanent_error", nil, 1)
	testamqp.Publish(t, e.ch, "", e.topo.DLQ, amqp.Publishing{MessageId: "transport-77", ContentType: consumer.ContentTypeCloudEvents, Headers: h,
		Body: []byte(`{"specversion":"1.0","id":"evt-1","source":"/orders","type":"order.placed","data":{"amount":12}}`)})
	e.waitReady(e.topo.DLQ, 1)
	want := dedup.Scope{Consumer: consumerName, Key: "/orders evt-1"}.KeyHash()
	byID := dedup.Scope{Consumer: consumerName, Key: "transport-77"}.KeyHash()

	p := e.get("/dlq?queue=" + url.QueryEscape(e.topo.Queue))
	mustContain(t, p, want)
	mustNotContain(t, p, byID, "evt-1", "transport-77")
	mustContain(t, e.get("/dlq/letter?queue="+url.QueryEscape(e.topo.Queue)+"&id="+field(t, letterID, p.body)), "key hash "+want)
	mustContain(t, e.post("/keys", url.Values{"consumer": {consumerName}, "key": {"/orders evt-1"}}), `<li class="where-dlq">`)

	if _, err := ui.New(ui.Config{Pool: e.pool, Dial: e.cfg.Dial, KeyFrom: "soap"}); err == nil {
		t.Fatal("an unknown key preset: want an error")
	}
}
