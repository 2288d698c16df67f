package interop

import (
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

func TestGUID(t *testing.T) {
	for id, want := range map[string]string{
		"181C0000-6393-3630-36A4-08DAF4E7C6DA":   "181c0000-6393-3630-36a4-08daf4e7c6da",
		"idemq-0123456789abcdef0123456789abcdef": "01234567-89ab-cdef-0123-456789abcdef",
	} {
		if got := GUID(id); got != want {
			t.Errorf("GUID(%q) = %q, want %q", id, got, want)
		}
	}
	if a, b := GUID("order-7"), GUID("order-7"); a != b || a == GUID("order-8") {
		t.Errorf("GUID of other ids: %q, %q, %q", a, b, GUID("order-8"))
	}
}

// What the outbox writes is read back by the presets: the same key, and
// the body as the payload.
func TestWrittenFormatsReadBack(t *testing.T) {
	ev := Event{ID: "idemq-0123456789abcdef0123456789abcdef", Source: "/s", Type: "t", Time: time.Unix(0, 0)}
	body := []byte(`{"a":1}`)
	headers, err := BinaryHeaders(ev, amqp.Table{"x": "kept"})
	if err != nil {
		t.Fatal(err)
	}
	structured, err := Structured(ev, body, "application/json")
	if err != nil {
		t.Fatal(err)
	}
	guid := GUID(ev.ID)
	envelope, err := MassTransitBody(Envelope{MessageID: guid, MessageType: []string{"urn:message:A:B"}, SentTime: time.Now()}, body)
	if err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]struct {
		preset string
		d      amqp.Delivery
		key    string
	}{
		"binary":      {CloudEvents, amqp.Delivery{Headers: headers, ContentType: "application/json", Body: body}, "/s " + ev.ID},
		"structured":  {CloudEvents, amqp.Delivery{ContentType: ContentTypeCloudEvents, Body: structured}, "/s " + ev.ID},
		"masstransit": {MassTransit, amqp.Delivery{ContentType: ContentTypeMassTransit, Body: envelope}, guid},
	} {
		read, _ := ReaderFor(tc.preset)
		key, payload, err := read(&tc.d, "")
		if err != nil || key != tc.key || string(payload) != string(body) {
			t.Errorf("%s: key %q payload %s err %v; want %q %s", name, key, payload, err, tc.key, body)
		}
	}
}
