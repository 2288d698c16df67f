package interop

import (
	"errors"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
)

func TestReaders(t *testing.T) {
	mtEnv := `{"messageId":"env-id","sentTime":"2023-01-12T21:55:53Z","message":{ "a" : 1 },"headers":{"MT-OriginalMessageId":"first-in-envelope"}}`
	tests := []struct {
		name    string
		preset  string
		d       amqp.Delivery
		key     string
		payload string
		err     bool
	}{
		{"message-id", MessageID, amqp.Delivery{MessageId: "m", Body: []byte("b")}, "m", "b", false},
		{"message-id header", "", amqp.Delivery{Headers: amqp.Table{"Idempotency-Key": "h"}, Body: []byte("b")}, "h", "b", false},
		{"masstransit transport header first", MassTransit, amqp.Delivery{MessageId: "new", ContentType: ContentTypeMassTransit, Headers: amqp.Table{"MT-OriginalMessageId": "first"}, Body: []byte(mtEnv)}, "first", `{"a":1}`, false},
		{"masstransit envelope header", MassTransit, amqp.Delivery{MessageId: "new", ContentType: ContentTypeMassTransit, Body: []byte(mtEnv)}, "first-in-envelope", `{"a":1}`, false},
		{"masstransit envelope id", MassTransit, amqp.Delivery{ContentType: ContentTypeMassTransit, Body: []byte(`{"messageId":"env-id","message":{}}`)}, "env-id", `{}`, false},
		{"masstransit raw json", MassTransit, amqp.Delivery{MessageId: "m", ContentType: "application/json", Body: []byte(`{"x":1}`)}, "m", `{"x":1}`, false},
		{"masstransit bad envelope", MassTransit, amqp.Delivery{ContentType: ContentTypeMassTransit, Body: []byte(`{`)}, "", "", true},
		{"masstransit header not text", MassTransit, amqp.Delivery{Headers: amqp.Table{"MT-OriginalMessageId": int32(1)}}, "", "", true},
		{"nservicebus header", NServiceBus, amqp.Delivery{MessageId: "other", Headers: amqp.Table{"NServiceBus.MessageId": "nsb"}, Body: []byte("b")}, "nsb", "b", false},
		{"nservicebus message_id", NServiceBus, amqp.Delivery{MessageId: "m", Body: []byte("b")}, "m", "b", false},
		{"wolverine", Wolverine, amqp.Delivery{MessageId: "w", Body: []byte("b")}, "w", "b", false},
		{"cloudevents binary underscore", CloudEvents, amqp.Delivery{Headers: amqp.Table{"cloudEvents_id": "1", "cloudEvents_source": "/s"}, Body: []byte("d")}, "/s 1", "d", false},
		{"cloudevents binary colon", CloudEvents, amqp.Delivery{Headers: amqp.Table{"cloudEvents:id": "1", "cloudEvents:source": "/s"}, Body: []byte("d")}, "/s 1", "d", false},
		{"cloudevents binary ce- any case", CloudEvents, amqp.Delivery{Headers: amqp.Table{"Ce-Id": []byte("1"), "ce-source": "/s"}, Body: []byte("d")}, "/s 1", "d", false},
		{"cloudevents structured", CloudEvents, amqp.Delivery{ContentType: "application/cloudevents+json; charset=utf-8", Body: []byte(`{"id":"1","source":"/s","data": {"k" : true}}`)}, "/s 1", `{"k":true}`, false},
		{"cloudevents structured base64", CloudEvents, amqp.Delivery{ContentType: ContentTypeCloudEvents, Body: []byte(`{"id":"1","source":"/s","data_base64":"aGk="}`)}, "/s 1", "hi", false},
		{"cloudevents none", CloudEvents, amqp.Delivery{MessageId: "m", Body: []byte("d")}, "", "d", false},
		{"cloudevents id alone", CloudEvents, amqp.Delivery{Headers: amqp.Table{"ce-id": "1"}}, "", "", true},
		{"cloudevents source with a space", CloudEvents, amqp.Delivery{Headers: amqp.Table{"ce-id": "1", "ce-source": "a b"}}, "", "", true},
		{"cloudevents structured not json", CloudEvents, amqp.Delivery{ContentType: ContentTypeCloudEvents, Body: []byte(`nope`)}, "", "", true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			read, err := ReaderFor(tc.preset)
			if err != nil {
				t.Fatal(err)
			}
			key, payload, err := read(&tc.d, "Idempotency-Key")
			if tc.err {
				if !errors.Is(err, ErrFormat) {
					t.Fatalf("err %v, want ErrFormat", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if key != tc.key || string(payload) != tc.payload {
				t.Errorf("got key %q payload %q, want %q %q", key, payload, tc.key, tc.payload)
			}
		})
	}
}

func TestReaderForUnknown(t *testing.T) {
	if _, err := ReaderFor("rebus"); err == nil {
		t.Fatal("unknown preset accepted")
	}
}
