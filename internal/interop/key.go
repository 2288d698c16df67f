package interop

import (
	"bytes"
	"cmp"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"strings"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/wire"
)

// Preset names: the values of consumer.KeyPreset and of idemq forward
// --key-from.
const (
	MessageID   = "message-id"
	MassTransit = "masstransit"
	NServiceBus = "nservicebus"
	Wolverine   = "wolverine"
	CloudEvents = "cloudevents"
)

// Presets lists the preset names, the default first.
func Presets() []string {
	return []string{MessageID, MassTransit, NServiceBus, Wolverine, CloudEvents}
}

// Header names and content types the frameworks write.
const (
	// HeaderMTOriginalMessageID is MassTransit's header for the first
	// MessageId of a message its redelivery or scheduler sent again with
	// a new one (MessageHeaders.OriginalMessageId).
	HeaderMTOriginalMessageID = "MT-OriginalMessageId"
	// ContentTypeMassTransit is the content type of MassTransit's JSON
	// envelope (UseJsonSerializer, the default serializer).
	ContentTypeMassTransit = "application/vnd.masstransit+json"
	// HeaderNSBMessageID is NServiceBus's message id header.
	HeaderNSBMessageID = "NServiceBus.MessageId"
	// ContentTypeCloudEvents is the content type of a CloudEvent in
	// structured mode, JSON event format.
	ContentTypeCloudEvents = "application/cloudevents+json"
)

// CloudEventsPrefixes are the header prefixes of CloudEvents attributes in
// binary mode: the AMQP binding's "cloudEvents:" and "cloudEvents_", and
// "ce-", which publishers reusing an HTTP or Kafka binding write. A prefix
// matches whatever its case.
var CloudEventsPrefixes = []string{"cloudEvents:", "cloudEvents_", "ce-"}

// ErrFormat reports a delivery that does not hold its preset's format (a
// header of the wrong type, an envelope that is not JSON).
var ErrFormat = errors.New("message is not in its framework's format")

// A Reader reads a delivery's key and the payload its fingerprint is
// computed over. keyHeader is the consumer's key header (the fallback of the
// message-id preset). A key of "" means the delivery carries none.
type Reader func(d *amqp.Delivery, keyHeader string) (key string, payload []byte, err error)

// ReaderFor returns the reader of a preset ("" is MessageID).
func ReaderFor(preset string) (Reader, error) {
	switch preset {
	case "", MessageID, Wolverine:
		// Wolverine maps its Envelope.Id to message_id.
		return readMessageID, nil
	case MassTransit:
		return readMassTransit, nil
	case NServiceBus:
		return readNServiceBus, nil
	case CloudEvents:
		return readCloudEvents, nil
	}
	return nil, fmt.Errorf("unknown key preset %q (one of %s)", preset, strings.Join(Presets(), ", "))
}

// readMessageID is idemq's own rule (wire.ReadKey) over the whole body.
func readMessageID(d *amqp.Delivery, keyHeader string) (string, []byte, error) {
	key, err := wire.ReadKey(d, keyHeader)
	return key, d.Body, err
}

// header reads a text header: "" when absent, an error when present and not text.
func header(d *amqp.Delivery, name string) (string, error) {
	v, present := d.Headers[name]
	if !present {
		return "", nil
	}
	s, ok := wire.String(v)
	if !ok {
		return "", fmt.Errorf("%w: header %s is a %T, not a string", ErrFormat, name, v)
	}
	return s, nil
}

// mediaType is the content type without its parameters, lower case.
func mediaType(contentType string) string {
	if t, _, err := mime.ParseMediaType(contentType); err == nil {
		return t
	}
	return strings.ToLower(strings.TrimSpace(contentType))
}

// mtEnvelope is what idemq reads of MassTransit's JSON envelope.
type mtEnvelope struct {
	MessageID string          `json:"messageId"`
	Message   json.RawMessage `json:"message"`
	Headers   map[string]any  `json:"headers"`
}

// readMassTransit keys on the first MessageId of the message:
// MT-OriginalMessageId (a transport header, or in the envelope's headers)
// when present, else message_id, else the envelope's messageId. The
// payload of an envelope is its "message"; of any other body (the raw JSON
// serializer), the body.
func readMassTransit(d *amqp.Delivery, _ string) (string, []byte, error) {
	key, err := header(d, HeaderMTOriginalMessageID)
	if err != nil {
		return "", nil, err
	}
	if mediaType(d.ContentType) != ContentTypeMassTransit {
		return cmp.Or(key, d.MessageId), d.Body, nil
	}
	var env mtEnvelope
	if err := json.Unmarshal(d.Body, &env); err != nil {
		return "", nil, fmt.Errorf("%w: MassTransit envelope: %v", ErrFormat, err)
	}
	if key == "" {
		if v, ok := env.Headers[HeaderMTOriginalMessageID].(string); ok {
			key = v
		}
	}
	payload, err := compact(env.Message)
	if err != nil {
		return "", nil, fmt.Errorf("%w: MassTransit envelope message: %v", ErrFormat, err)
	}
	return cmp.Or(key, d.MessageId, env.MessageID), payload, nil
}

// readNServiceBus keys on the NServiceBus.MessageId header, else
// message_id (which NServiceBus's RabbitMQ transport sets to the same id).
func readNServiceBus(d *amqp.Delivery, _ string) (string, []byte, error) {
	key, err := header(d, HeaderNSBMessageID)
	if err != nil {
		return "", nil, err
	}
	return cmp.Or(key, d.MessageId), d.Body, nil
}

// ceStructured is what idemq reads of a structured-mode CloudEvent.
type ceStructured struct {
	ID         string          `json:"id"`
	Source     string          `json:"source"`
	Data       json.RawMessage `json:"data"`
	DataBase64 string          `json:"data_base64"`
}

// readCloudEvents keys on the event's source and id (CloudEventKey). A
// delivery whose content type is application/cloudevents+json is a
// structured event: one decode of the body gives source, id and data (the
// payload; data_base64 decoded). Any other is read in binary mode: source
// and id from prefixed headers, the body the payload. A delivery with
// neither id nor source carries no key.
func readCloudEvents(d *amqp.Delivery, _ string) (string, []byte, error) {
	if mediaType(d.ContentType) == ContentTypeCloudEvents {
		var ev ceStructured
		if err := json.Unmarshal(d.Body, &ev); err != nil {
			return "", nil, fmt.Errorf("%w: structured CloudEvent: %v", ErrFormat, err)
		}
		payload, err := compact(ev.Data)
		if err == nil && ev.DataBase64 != "" {
			payload, err = base64.StdEncoding.DecodeString(ev.DataBase64)
		}
		if err != nil {
			return "", nil, fmt.Errorf("%w: structured CloudEvent data: %v", ErrFormat, err)
		}
		key, err := CloudEventKey(ev.Source, ev.ID)
		return key, payload, err
	}
	id, err := ceHeader(d, "id")
	if err != nil {
		return "", nil, err
	}
	source, err := ceHeader(d, "source")
	if err != nil {
		return "", nil, err
	}
	key, err := CloudEventKey(source, id)
	return key, d.Body, err
}

// ceHeader reads the binary-mode attribute attr under any of the prefixes.
func ceHeader(d *amqp.Delivery, attr string) (string, error) {
	for name, v := range d.Headers {
		for _, p := range CloudEventsPrefixes {
			if len(name) == len(p)+len(attr) && strings.EqualFold(name[:len(p)], p) && strings.EqualFold(name[len(p):], attr) {
				s, ok := wire.String(v)
				if !ok {
					return "", fmt.Errorf("%w: header %s is a %T, not a string", ErrFormat, name, v)
				}
				return s, nil
			}
		}
	}
	return "", nil
}

// CloudEventKey is the key of the CloudEvent (source, id): "source id",
// unambiguous because a source (a URI-reference) holds no space; a source
// with a space is refused. Both empty: no key (""); one of them missing: an
// error (a CloudEvent is identified by both).
func CloudEventKey(source, id string) (string, error) {
	switch {
	case source == "" && id == "":
		return "", nil
	case source == "" || id == "":
		return "", fmt.Errorf("%w: a CloudEvent needs both source and id", ErrFormat)
	case strings.ContainsAny(source, " \t"):
		return "", fmt.Errorf("%w: CloudEvent source holds a space", ErrFormat)
	}
	return source + " " + id, nil
}

// compact returns raw JSON without insignificant spaces, so that a
// framework that re-indents a resent payload does not change its
// fingerprint; absent (nil) stays nil.
func compact(raw json.RawMessage) ([]byte, error) {
	if raw == nil {
		return nil, nil
	}
	var b bytes.Buffer
	if err := json.Compact(&b, raw); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}
