package consumer_test

import (
	"bytes"
	"encoding/json"
	"maps"
	"os"
	"path/filepath"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testamqp"
)

// fixture reads a body of testdata/interop (see its README for sources).
func fixture(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "interop", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// compacted is body without its spaces: the same JSON, other bytes.
func compacted(t *testing.T, body []byte) []byte {
	t.Helper()
	var b bytes.Buffer
	if err := json.Compact(&b, body); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// presetCase is a sequence of messages as a framework publishes them, and
// what a consumer keyed by the framework's preset must make of them.
type presetCase struct {
	preset consumer.KeyPreset
	msgs   []amqp.Publishing
	// effects is the ledger wanted: one row per operation, by key.
	effects map[string]int
	// duplicates is how many of msgs are suppressed.
	duplicates int
	// byMessageID is how many effects keying on message_id alone would
	// apply: more than len(effects) when the case holds a duplicate that
	// message_id keying lets through.
	byMessageID int
}

const (
	mtFirst    = "181c0000-6393-3630-36a4-08daf4e7c6da"
	mtResent   = "181c0000-6393-3630-9b2e-08daf4e7d1f3"
	mtOther    = "181c0000-6393-3630-51c7-08daf4e8a0b2"
	nsbFirst   = "b2f6c0de-4a71-4c0e-9d35-b1a200c8e5a1"
	nsbOther   = "e0a1c7f3-98d2-4b6a-a4f1-b1a200c8e9c4"
	wolvFirst  = "0190f3a2-7c1e-7b9d-8e4f-3a6b2c1d0e9f"
	wolvOther  = "0190f3a2-8d2f-7c0e-9f50-4b7c3d2e1f0a"
	ceOrderID  = "7d1c3f9e-order-1"
	ceStructID = "A234-1234-1234"
)

func presetCases(t *testing.T) map[string]presetCase {
	mt := consumer.ContentTypeMassTransit
	// NServiceBus's headers (Particular docs, "Message Headers"); its
	// RabbitMQ transport also sets message_id to NServiceBus.MessageId.
	nsb := func(id string) amqp.Table {
		return amqp.Table{
			"NServiceBus.MessageId":            id,
			"NServiceBus.CorrelationId":        id,
			"NServiceBus.MessageIntent":        "Send",
			"NServiceBus.ContentType":          "application/json",
			"NServiceBus.EnclosedMessageTypes": "Sales.Messages.PlaceOrder, Sales.Messages, Version=1.0.0.0, Culture=neutral, PublicKeyToken=null",
			"NServiceBus.OriginatingEndpoint":  "ClientUI",
			"NServiceBus.TimeSent":             "2024-03-01 10:15:42:118523 Z",
			"NServiceBus.Version":              "9.0.0",
		}
	}
	// CloudEvents binary mode over AMQP (amqp-protocol-binding.md 3.1.3):
	// attributes in prefixed application properties.
	ceBinary := func(prefix, source, id string) amqp.Table {
		return amqp.Table{
			prefix + "specversion": "1.0",
			prefix + "type":        "com.example.order.placed",
			prefix + "source":      source,
			prefix + "id":          id,
			prefix + "time":        "2024-03-01T10:15:42Z",
		}
	}
	structured := fixture(t, "cloudevents-structured.json")
	ceData := []byte(`{"orderId":"7d1c3f9e","total":42.5}`)
	return map[string]presetCase{
		"masstransit": {
			preset: consumer.KeyFromMassTransit,
			msgs: []amqp.Publishing{
				{MessageId: mtFirst, ContentType: mt, Body: fixture(t, "masstransit-submit-order.json")},
				// MassTransit's redelivery: a new MessageId, the first one in
				// MT-OriginalMessageId, a new sentTime and host.
				{MessageId: mtResent, ContentType: mt, Headers: amqp.Table{"MT-OriginalMessageId": mtFirst},
					Body: fixture(t, "masstransit-submit-order-redelivered.json")},
				{MessageId: mtOther, ContentType: mt, Body: fixture(t, "masstransit-submit-order-other.json")},
			},
			effects:     map[string]int{mtFirst: 1, mtOther: 1},
			duplicates:  1,
			byMessageID: 3,
		},
		"masstransit envelope only": {
			// No message_id, no transport header: the envelope says it all.
			preset: consumer.KeyFromMassTransit,
			msgs: []amqp.Publishing{
				{ContentType: mt, Body: fixture(t, "masstransit-submit-order.json")},
				{ContentType: mt, Body: fixture(t, "masstransit-submit-order-redelivered.json")},
			},
			effects:    map[string]int{mtFirst: 1},
			duplicates: 1,
		},
		"nservicebus": {
			preset: consumer.KeyFromNServiceBus,
			msgs: []amqp.Publishing{
				{MessageId: nsbFirst, ContentType: "application/json", Headers: nsb(nsbFirst), Body: fixture(t, "nservicebus-place-order.json")},
				// The same message sent on by a bridge that gave it a
				// message_id of its own: NServiceBus.MessageId is kept.
				{MessageId: "bridge-5f1e2d3c", ContentType: "application/json", Headers: nsb(nsbFirst), Body: fixture(t, "nservicebus-place-order.json")},
				{MessageId: nsbOther, ContentType: "application/json", Headers: nsb(nsbOther), Body: []byte(`{"OrderId":"c4d1e2f3","Product":"Old boots"}`)},
			},
			effects:     map[string]int{nsbFirst: 1, nsbOther: 1},
			duplicates:  1,
			byMessageID: 3,
		},
		"wolverine": {
			preset: consumer.KeyFromWolverine,
			msgs: []amqp.Publishing{
				{MessageId: wolvFirst, ContentType: "application/json", Headers: amqp.Table{"message-type": "OrderPlaced"}, Body: fixture(t, "wolverine-order-placed.json")},
				{MessageId: wolvFirst, ContentType: "application/json", Headers: amqp.Table{"message-type": "OrderPlaced"}, Body: fixture(t, "wolverine-order-placed.json")},
				{MessageId: wolvOther, ContentType: "application/json", Headers: amqp.Table{"message-type": "OrderPlaced"}, Body: []byte(`{"OrderId":"9a8b7c6d","Total":7}`)},
			},
			effects:     map[string]int{wolvFirst: 1, wolvOther: 1},
			duplicates:  1,
			byMessageID: 2,
		},
		"cloudevents": {
			preset: consumer.KeyFromCloudEvents,
			msgs: []amqp.Publishing{
				{MessageId: "m-1", ContentType: "application/json", Headers: ceBinary("cloudEvents_", "/orders", ceOrderID), Body: ceData},
				// Resent with the same source and id and a new message_id.
				{MessageId: "m-2", ContentType: "application/json", Headers: ceBinary("cloudEvents_", "/orders", ceOrderID), Body: ceData},
				{MessageId: "m-3", ContentType: consumer.ContentTypeCloudEvents, Body: structured},
				// The same structured event resent, its JSON written
				// without spaces.
				{MessageId: "m-4", ContentType: consumer.ContentTypeCloudEvents + "; charset=utf-8", Body: compacted(t, structured)},
				// The same id from another source: another event.
				{MessageId: "m-5", ContentType: "application/json", Headers: ceBinary("cloudEvents:", "/billing", ceOrderID), Body: ceData},
			},
			effects:     map[string]int{"/orders " + ceOrderID: 1, "/mycontext " + ceStructID: 1, "/billing " + ceOrderID: 1},
			duplicates:  2,
			byMessageID: 5,
		},
	}
}

// Each framework's messages, published as the framework does, are keyed
// by the framework's own id: its duplicates are suppressed, the distinct
// messages processed, and keying on message_id alone would have let the
// duplicates through.
func TestKeyPreset(t *testing.T) {
	t.Parallel()
	for name, tc := range presetCases(t) {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			got := runPreset(t, tc.preset, tc.msgs)
			if !maps.Equal(got.effects, tc.effects) {
				t.Errorf("effects %v, want %v", got.effects, tc.effects)
			}
			if got.outcomes[consumer.OutcomeDuplicate] != tc.duplicates || got.outcomes[consumer.OutcomeProcessed] != len(tc.effects) {
				t.Errorf("outcomes %v, want %d processed and %d duplicates", got.outcomes, len(tc.effects), tc.duplicates)
			}
		})
		if tc.byMessageID == 0 {
			continue
		}
		t.Run(name+" by message_id", func(t *testing.T) {
			t.Parallel()
			got := runPreset(t, consumer.KeyFromMessageID, tc.msgs)
			n := 0
			for _, c := range got.effects {
				n += c
			}
			if n != tc.byMessageID {
				t.Errorf("message_id keying applied %d effects %v, want %d", n, got.effects, tc.byMessageID)
			}
		})
	}
}

type presetRun struct {
	effects  map[string]int
	outcomes map[consumer.Outcome]int
}

// runPreset publishes msgs in order to a consumer keyed by preset and
// returns what it made of them once every message reached its end.
func runPreset(t *testing.T, preset consumer.KeyPreset, msgs []amqp.Publishing) presetRun {
	h := newHarness(t, modeGroup, func(c *consumer.Config) { c.KeyFrom = preset })
	h.start(1, h.ledgerEffect)
	for i, m := range msgs {
		testamqp.Publish(t, h.pub, "", h.cfg.Queue, m)
		// One at a time: a duplicate must meet its original completed.
		h.waitEvents(10*time.Second, "message settled", func(evs []consumer.Event) bool { return finals(evs) == i+1 })
	}
	h.mu.Lock()
	evs := append([]consumer.Event(nil), h.events...)
	h.mu.Unlock()
	return presetRun{effects: h.effects(), outcomes: countOutcomes(evs)}
}

// A framework's trace context in a header of its own naming is continued:
// MassTransit's MT-Activity-Id (its Activity's W3C id), a binary
// CloudEvent's traceparent attribute (the distributed tracing extension).
// The message-id preset reads only traceparent.
func TestKeyPresetContinuesTheFrameworksTrace(t *testing.T) {
	t.Parallel()
	const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	parent := "00-" + traceID + "-00f067aa0ba902b7-01"
	for name, tc := range map[string]struct {
		preset consumer.KeyPreset
		msg    amqp.Publishing
		same   bool
	}{
		"masstransit": {consumer.KeyFromMassTransit, amqp.Publishing{MessageId: mtFirst, Headers: amqp.Table{"MT-Activity-Id": parent}}, true},
		"cloudevents": {consumer.KeyFromCloudEvents, amqp.Publishing{Headers: amqp.Table{"cloudEvents_id": "1", "cloudEvents_source": "/s", "cloudEvents_traceparent": parent}}, true},
		"ce- prefix":  {consumer.KeyFromCloudEvents, amqp.Publishing{Headers: amqp.Table{"ce-id": "1", "ce-source": "/s", "ce-traceparent": parent}}, true},
		"message-id":  {consumer.KeyFromMessageID, amqp.Publishing{MessageId: mtFirst, Headers: amqp.Table{"MT-Activity-Id": parent}}, false},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, modeGroup, func(c *consumer.Config) { c.KeyFrom = tc.preset })
			h.start(1, h.ledgerEffect)
			tc.msg.Body = []byte(`{}`)
			testamqp.Publish(t, h.pub, "", h.cfg.Queue, tc.msg)
			evs := h.waitEvents(10*time.Second, "message processed", func(evs []consumer.Event) bool { return finals(evs) == 1 })
			if got := evs[0].TraceID == traceID; got != tc.same || evs[0].Outcome != consumer.OutcomeProcessed {
				t.Errorf("outcome %s, trace %s; want the trace %s continued: %v", evs[0].Outcome, evs[0].TraceID, traceID, tc.same)
			}
		})
	}
}

// A message that does not hold its preset's format cannot be keyed: it is
// dead-lettered as an invalid key; one with no id at all as a missing key.
func TestKeyPresetRefusesMalformedMessages(t *testing.T) {
	t.Parallel()
	h := newHarness(t, modeGroup, func(c *consumer.Config) { c.KeyFrom = consumer.KeyFromCloudEvents })
	h.start(1, h.ledgerEffect)
	for _, m := range []amqp.Publishing{
		{MessageId: "m-1", ContentType: consumer.ContentTypeCloudEvents, Body: []byte(`{"id":"1","source":`)},
		{MessageId: "m-2", Headers: amqp.Table{"cloudEvents_id": "1"}, Body: []byte(`{}`)},
		{MessageId: "m-3", Body: []byte(`{}`)},
	} {
		testamqp.Publish(t, h.pub, "", h.cfg.Queue, m)
	}
	reasons := map[string]string{}
	for _, d := range h.waitDLQ(3, 10*time.Second) {
		reasons[d.MessageId], _ = d.Headers[consumer.HeaderReason].(string)
	}
	want := map[string]string{"m-1": consumer.ReasonKeyInvalid, "m-2": consumer.ReasonKeyInvalid, "m-3": consumer.ReasonKeyRequired}
	if !maps.Equal(reasons, want) {
		t.Errorf("dead-letter reasons %v, want %v", reasons, want)
	}
	if n := len(h.effects()); n != 0 {
		t.Errorf("%d effects", n)
	}
}
