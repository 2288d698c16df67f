package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/outbox"
)

// Messages enqueued with a Format reach the broker in that framework's
// format, their message id kept: a CloudEvent in binary mode (cloudEvents_
// headers) and in structured mode (an application/cloudevents+json body),
// and MassTransit's JSON envelope, whose messageId is the message id as a
// GUID.
func TestRelayWritesFrameworkFormats(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	ctx := context.Background()
	at := time.Date(2026, 3, 1, 10, 15, 42, 0, time.UTC)
	ce := outbox.CloudEvent{Source: "/payments", Type: "com.example.payment.charged", Subject: "order-7", Time: at}
	structured := ce
	structured.Structured = true
	msgs := []outbox.Message{
		{MessageID: "binary", ContentType: "application/json", Body: []byte(`{"amount":42}`), Format: ce},
		{MessageID: "structured", ContentType: "application/json", Body: []byte(`{"amount":42}`), Format: structured},
		{MessageID: "opaque", ContentType: "application/octet-stream", Body: []byte{0, 1, 2}, Format: structured},
		{MessageID: "idemq-0123456789abcdef0123456789abcdef", Body: []byte(`{"orderId":7}`), Format: outbox.MassTransit{
			MessageType: []string{"urn:message:Company.Project:SubmitOrder"}, SourceAddress: "rabbitmq://localhost/payments",
		}},
	}
	for i := range msgs {
		msgs[i].Exchange, msgs[i].RoutingKey = e.exchange, boundKey
	}
	if err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return e.ob.EnqueueBatch(ctx, tx, msgs) }); err != nil {
		t.Fatalf("enqueue: %v", err)
	}
	e.startRelay(t, e.relayConfig(t))
	_, got := e.consumeAll(t, len(msgs), 20*time.Second)
	byID := map[string]int{}
	for i, d := range got {
		byID[d.MessageId] = i
	}

	bin := got[byID["binary"]]
	for name, want := range map[string]string{
		"cloudEvents_specversion": "1.0", "cloudEvents_id": "binary", "cloudEvents_source": "/payments",
		"cloudEvents_type": "com.example.payment.charged", "cloudEvents_subject": "order-7", "cloudEvents_time": "2026-03-01T10:15:42Z",
	} {
		if v, _ := bin.Headers[name].(string); v != want {
			t.Errorf("binary: header %s = %v, want %q", name, bin.Headers[name], want)
		}
	}
	if bin.ContentType != "application/json" || string(bin.Body) != `{"amount":42}` {
		t.Errorf("binary: content type %q, body %s", bin.ContentType, bin.Body)
	}

	var ev struct {
		SpecVersion, ID, Source, Type, Subject, Time, DataContentType string
		Data                                                          json.RawMessage
		DataBase64                                                    string `json:"data_base64"`
	}
	st := got[byID["structured"]]
	if err := json.Unmarshal(st.Body, &ev); err != nil {
		t.Fatalf("structured: %v: %s", err, st.Body)
	}
	if st.ContentType != consumer.ContentTypeCloudEvents || ev.SpecVersion != "1.0" || ev.ID != "structured" || ev.Source != "/payments" ||
		ev.Time != "2026-03-01T10:15:42Z" || ev.DataContentType != "application/json" || string(ev.Data) != `{"amount":42}` {
		t.Errorf("structured: content type %q, body %s", st.ContentType, st.Body)
	}
	op := got[byID["opaque"]]
	ev.Data = nil
	if err := json.Unmarshal(op.Body, &ev); err != nil || ev.DataBase64 != "AAEC" || ev.Data != nil {
		t.Errorf("structured, not JSON: %v: %s", err, op.Body)
	}

	const guid = "01234567-89ab-cdef-0123-456789abcdef"
	mt, ok := byID[guid]
	if !ok {
		t.Fatalf("no MassTransit message with message_id %s: %v", guid, byID)
	}
	var env struct {
		MessageID     string          `json:"messageId"`
		MessageType   []string        `json:"messageType"`
		Message       json.RawMessage `json:"message"`
		SourceAddress string          `json:"sourceAddress"`
		SentTime      string          `json:"sentTime"`
	}
	if err := json.Unmarshal(got[mt].Body, &env); err != nil {
		t.Fatalf("MassTransit: %v: %s", err, got[mt].Body)
	}
	if got[mt].ContentType != consumer.ContentTypeMassTransit || env.MessageID != guid || len(env.MessageType) != 1 ||
		env.MessageType[0] != "urn:message:Company.Project:SubmitOrder" || string(env.Message) != `{"orderId":7}` ||
		env.SourceAddress != "rabbitmq://localhost/payments" || env.SentTime == "" {
		t.Errorf("MassTransit: content type %q, body %s", got[mt].ContentType, got[mt].Body)
	}
}

// A Format that cannot write its message is refused at Enqueue.
func TestEnqueueRefusesAnUnwritableFormat(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx := context.Background()
	for name, m := range map[string]outbox.Message{
		"cloudevent without source":      {Body: []byte(`{}`), Format: outbox.CloudEvent{Type: "t"}},
		"cloudevent without type":        {Body: []byte(`{}`), Format: outbox.CloudEvent{Source: "/s"}},
		"masstransit without type":       {Body: []byte(`{}`), Format: outbox.MassTransit{}},
		"masstransit body that not JSON": {Body: []byte(`nope`), Format: outbox.MassTransit{MessageType: []string{"urn:message:A:B"}}},
	} {
		err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return e.ob.Enqueue(ctx, tx, m) })
		if !errors.Is(err, outbox.ErrFormat) {
			t.Errorf("%s: %v, want ErrFormat", name, err)
		}
	}
}
