package outbox

import (
	"errors"
	"fmt"
	"time"

	"github.com/idemq/idemq/internal/interop"
)

// ErrFormat reports a Message its Format cannot write (a CloudEvent
// without source or type, a MassTransit message whose body is not JSON).
// Enqueue returns it wrapped.
var ErrFormat = errors.New("message cannot be written in its format")

// A Format writes a Message in another framework's format when it is
// enqueued, so that consumers on that framework read what the relay
// publishes (docs/interop.md): CloudEvent or MassTransit. The message id
// (given, or derived from the claim) is kept in every format. The row holds
// the written message: every publish of it, a re-publish after a crash
// included, is the same bytes.
type Format interface {
	write(m *Message) error
}

// CloudEvent writes the message as a CloudEvent (spec 1.0) whose id is the
// message id, with the Source, Type and Subject given, and Time (the
// enqueue time when zero). In binary mode, the default, the body and
// content type stay the event's data and datacontenttype, and the
// attributes go into headers prefixed cloudEvents_ (the AMQP binding's).
// Structured writes the whole event as the body, in the JSON event format
// (content type application/cloudevents+json): data as JSON for a JSON
// content type (or none and a JSON body), else data_base64.
type CloudEvent struct {
	// Source and Type are required: source + id identify the event.
	Source, Type string
	// Subject is optional.
	Subject string
	// Time is the event's time; zero means when it is enqueued.
	Time time.Time
	// Structured writes the event as the body instead of headers.
	Structured bool
}

func (c CloudEvent) write(m *Message) error {
	ev := interop.Event{ID: m.MessageID, Source: c.Source, Type: c.Type, Subject: c.Subject, Time: c.Time}
	if ev.Time.IsZero() {
		ev.Time = time.Now()
	}
	if !c.Structured {
		h, err := interop.BinaryHeaders(ev, m.Headers)
		if err != nil {
			return fmt.Errorf("%w: %w", ErrFormat, err)
		}
		m.Headers = h
		return nil
	}
	body, err := interop.Structured(ev, m.Body, m.ContentType)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrFormat, err)
	}
	m.Body, m.ContentType = body, interop.ContentTypeCloudEvents
	return nil
}

// MassTransit writes the message in MassTransit's JSON envelope (content
// type application/vnd.masstransit+json), so that a MassTransit consumer
// of the exchange receives a typed message: the body, which must be JSON,
// is the envelope's message. MassTransit's MessageId is a GUID: the message
// id is written as one (idemq's derived ids are 128 bits already; any
// other id that is not a GUID gives a name-based GUID of it), in the
// envelope and in message_id, the same on every publish.
type MassTransit struct {
	// MessageType lists the message's types as MassTransit names them,
	// "urn:message:Namespace:TypeName", the consumer's first. Required.
	MessageType []string
	// SourceAddress and DestinationAddress are the envelope's addresses
	// (rabbitmq://host/name), optional.
	SourceAddress, DestinationAddress string
	// ConversationID is the envelope's conversationId, optional; its
	// correlationId is the message's CorrelationID.
	ConversationID string
}

func (f MassTransit) write(m *Message) error {
	id := interop.GUID(m.MessageID)
	body, err := interop.MassTransitBody(interop.Envelope{
		MessageID: id, CorrelationID: m.CorrelationID, ConversationID: f.ConversationID,
		SourceAddress: f.SourceAddress, DestinationAddress: f.DestinationAddress,
		MessageType: f.MessageType, SentTime: time.Now(),
	}, m.Body)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrFormat, err)
	}
	m.MessageID, m.Body, m.ContentType = id, body, interop.ContentTypeMassTransit
	return nil
}
