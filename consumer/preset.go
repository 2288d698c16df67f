package consumer

import (
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/interop"
)

// A KeyPreset says where the messages of a framework carry their identity,
// the key idemq claims, and which part of them is the operation's payload,
// the bytes Config.Fingerprint is computed over (docs/interop.md):
//
//   - KeyFromMessageID (the default): the message_id property, else the
//     KeyHeader header; the payload is the body.
//   - KeyFromMassTransit: the MT-OriginalMessageId header (a transport
//     header, or in the envelope's headers) that MassTransit's redelivery
//     and scheduler put on a copy they send with a new MessageId, else
//     message_id, else the envelope's messageId; the payload of a JSON
//     envelope (ContentTypeMassTransit) is its "message" (sentTime, host
//     and the other envelope fields change on every send), of any other
//     body the body.
//   - KeyFromNServiceBus: the NServiceBus.MessageId header, else
//     message_id; the payload is the body.
//   - KeyFromWolverine: message_id, where Wolverine's RabbitMQ mapper
//     writes its Envelope.Id; the payload is the body.
//   - KeyFromCloudEvents: the event's source and id, "source id" (a
//     CloudEvent is identified by both): from a structured event
//     (ContentTypeCloudEvents, decoded once), else from binary-mode headers
//     prefixed cloudEvents_, cloudEvents: or ce-; the payload is the
//     event's data (data_base64 decoded), of a binary event the body.
//
// A JSON payload read out of an envelope is compacted first, so that a
// resend written with other spaces is the same operation.
//
// A delivery without a traceparent header continues the trace its
// framework wrote elsewhere: MassTransit's MT-Activity-Id, a binary
// CloudEvent's traceparent attribute (cloudEvents_traceparent,
// ce-traceparent).
type KeyPreset string

// The key presets.
const (
	KeyFromMessageID   KeyPreset = interop.MessageID
	KeyFromMassTransit KeyPreset = interop.MassTransit
	KeyFromNServiceBus KeyPreset = interop.NServiceBus
	KeyFromWolverine   KeyPreset = interop.Wolverine
	KeyFromCloudEvents KeyPreset = interop.CloudEvents
)

// Content types the key presets read a body by.
const (
	// ContentTypeMassTransit is MassTransit's JSON envelope.
	ContentTypeMassTransit = interop.ContentTypeMassTransit
	// ContentTypeCloudEvents is a structured-mode CloudEvent.
	ContentTypeCloudEvents = interop.ContentTypeCloudEvents
)

// KeyPresets lists the key presets, the default first.
func KeyPresets() []KeyPreset {
	var out []KeyPreset
	for _, p := range interop.Presets() {
		out = append(out, KeyPreset(p))
	}
	return out
}

// ParseKeyPreset returns the preset named s (as idemq forward --key-from
// takes it), or an error naming the presets.
func ParseKeyPreset(s string) (KeyPreset, error) {
	if _, err := interop.ReaderFor(s); err != nil {
		return "", err
	}
	return KeyPreset(s), nil
}

// An identifier reads a delivery's key and the payload its fingerprint is
// computed over; New picks it from the Config.
type identifier func(d *amqp.Delivery) (key string, payload []byte, err error)

// newIdentifier picks the identifier of c: its KeyFunc over the whole body,
// else its KeyFrom preset. A preset's reading error wraps
// dedup.ErrKeyInvalid.
func newIdentifier(c *Config) (identifier, error) {
	if c.KeyFunc != nil {
		if c.KeyFrom != "" {
			return nil, fmt.Errorf("key function and key preset %q are both set; choose one", c.KeyFrom)
		}
		f := c.KeyFunc
		return func(d *amqp.Delivery) (string, []byte, error) { return f(d), d.Body, nil }, nil
	}
	read, err := interop.ReaderFor(string(c.KeyFrom))
	if err != nil {
		return nil, err
	}
	header := c.KeyHeader
	return func(d *amqp.Delivery) (string, []byte, error) {
		key, payload, err := read(d, header)
		if err != nil {
			return "", nil, fmt.Errorf("%w: %w", dedup.ErrKeyInvalid, err)
		}
		return key, payload, nil
	}, nil
}
