package interop

import (
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"
)

// CloudEventsHeaderPrefix is the prefix of the binary-mode attributes idemq
// writes: the one the AMQP binding prefers.
const CloudEventsHeaderPrefix = "cloudEvents_"

// Event holds the attributes of a CloudEvent (spec 1.0) idemq writes.
type Event struct {
	ID, Source, Type, Subject string
	Time                      time.Time
}

func (e Event) check() error {
	switch {
	case e.ID == "":
		return fmt.Errorf("%w: a CloudEvent needs an id", ErrFormat)
	case e.Source == "":
		return fmt.Errorf("%w: a CloudEvent needs a source", ErrFormat)
	case e.Type == "":
		return fmt.Errorf("%w: a CloudEvent needs a type", ErrFormat)
	}
	return nil
}

// BinaryHeaders returns headers with the event's attributes added under
// CloudEventsHeaderPrefix (headers itself is not changed). The body and
// its content type stay as they are: in binary mode they are the event's
// data and datacontenttype.
func BinaryHeaders(e Event, headers amqp.Table) (amqp.Table, error) {
	if err := e.check(); err != nil {
		return nil, err
	}
	out := make(amqp.Table, len(headers)+6)
	for k, v := range headers {
		out[k] = v
	}
	p := CloudEventsHeaderPrefix
	out[p+"specversion"], out[p+"id"], out[p+"source"], out[p+"type"] = "1.0", e.ID, e.Source, e.Type
	out[p+"time"] = e.Time.UTC().Format(time.RFC3339Nano)
	if e.Subject != "" {
		out[p+"subject"] = e.Subject
	}
	return out, nil
}

// structuredEvent is the JSON event format.
type structuredEvent struct {
	SpecVersion     string          `json:"specversion"`
	ID              string          `json:"id"`
	Source          string          `json:"source"`
	Type            string          `json:"type"`
	Subject         string          `json:"subject,omitempty"`
	Time            string          `json:"time"`
	DataContentType string          `json:"datacontenttype,omitempty"`
	Data            json.RawMessage `json:"data,omitempty"`
	DataBase64      string          `json:"data_base64,omitempty"`
}

// Structured returns the event with data body of content type contentType
// in the JSON event format (its content type is ContentTypeCloudEvents):
// data as JSON when contentType is JSON (or empty and the body is JSON),
// else data_base64.
func Structured(e Event, body []byte, contentType string) ([]byte, error) {
	if err := e.check(); err != nil {
		return nil, err
	}
	ev := structuredEvent{
		SpecVersion: "1.0", ID: e.ID, Source: e.Source, Type: e.Type, Subject: e.Subject,
		Time: e.Time.UTC().Format(time.RFC3339Nano), DataContentType: contentType,
	}
	switch {
	case isJSON(contentType):
		if !json.Valid(body) {
			return nil, fmt.Errorf("%w: content type %s, but the body is not JSON", ErrFormat, contentType)
		}
		ev.Data = body
	case contentType == "" && json.Valid(body):
		ev.Data, ev.DataContentType = body, "application/json"
	case len(body) > 0:
		ev.DataBase64 = base64.StdEncoding.EncodeToString(body)
	}
	out, err := json.Marshal(ev)
	if err != nil {
		return nil, fmt.Errorf("%w: encode CloudEvent: %v", ErrFormat, err)
	}
	return out, nil
}

// isJSON reports whether a content type is JSON: application/json or a
// +json suffix.
func isJSON(contentType string) bool {
	t := mediaType(contentType)
	return t == "application/json" || strings.HasSuffix(t, "+json")
}

// Envelope holds what idemq writes of MassTransit's JSON envelope.
type Envelope struct {
	MessageID, CorrelationID, ConversationID string
	SourceAddress, DestinationAddress        string
	MessageType                              []string
	SentTime                                 time.Time
}

// mtOut is MassTransit's envelope as its JSON serializer writes it.
type mtOut struct {
	MessageID          string          `json:"messageId"`
	CorrelationID      string          `json:"correlationId,omitempty"`
	ConversationID     string          `json:"conversationId,omitempty"`
	SourceAddress      string          `json:"sourceAddress,omitempty"`
	DestinationAddress string          `json:"destinationAddress,omitempty"`
	MessageType        []string        `json:"messageType"`
	Message            json.RawMessage `json:"message"`
	SentTime           string          `json:"sentTime"`
}

// MassTransitBody returns body, a JSON message, in MassTransit's envelope
// (content type ContentTypeMassTransit). MessageID must be a GUID (GUID).
func MassTransitBody(e Envelope, body []byte) ([]byte, error) {
	if len(e.MessageType) == 0 {
		return nil, fmt.Errorf("%w: a MassTransit envelope needs a message type (urn:message:Namespace:TypeName)", ErrFormat)
	}
	if !json.Valid(body) {
		return nil, fmt.Errorf("%w: a MassTransit envelope's message must be JSON", ErrFormat)
	}
	out, err := json.Marshal(mtOut{
		MessageID: e.MessageID, CorrelationID: e.CorrelationID, ConversationID: e.ConversationID,
		SourceAddress: e.SourceAddress, DestinationAddress: e.DestinationAddress,
		MessageType: e.MessageType, Message: body, SentTime: e.SentTime.UTC().Format(time.RFC3339Nano),
	})
	if err != nil {
		return nil, fmt.Errorf("%w: encode MassTransit envelope: %v", ErrFormat, err)
	}
	return out, nil
}

// guidSpace names the GUIDs GUID derives from ids that hold none.
var guidSpace = uuid.MustParse("5b2c1f0e-8a47-4c3e-9d61-7f0e2a9b4c11")

// GUID returns id as a GUID, the type of MassTransit's MessageId: id itself
// when it is one; the 128 bits of idemq's derived ids ("idemq-" and 32 hex
// digits) written as one; else a name-based (SHA-1, version 5) GUID of id.
// The same id always gives the same GUID.
func GUID(id string) string {
	if u, err := uuid.Parse(id); err == nil {
		return u.String()
	}
	if h, ok := strings.CutPrefix(id, "idemq-"); ok && len(h) == 32 {
		if b, err := hex.DecodeString(h); err == nil {
			return uuid.UUID(b).String()
		}
	}
	return uuid.NewSHA1(guidSpace, []byte(id)).String()
}
