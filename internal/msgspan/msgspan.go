// Package msgspan is the one builder of idemq's messaging spans and the
// carrier that moves trace context in and out of AMQP headers, so that the
// consumer's retry and dead-letter copies, the outbox relay and
// outbox/publish name and describe a publish the same way (OpenTelemetry
// messaging semantic conventions: operation type "send", operation name
// "publish", a producer span).
package msgspan

import (
	"context"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/internal/wire"
)

// DefaultExchange is the name the conventions give the default exchange ("").
const DefaultExchange = "amq.default"

// Publish describes one message sent to the broker.
type Publish struct {
	// Name is the span's name. Default "<destination> publish".
	Name string
	// Exchange and RoutingKey are where the message goes.
	Exchange, RoutingKey string
	// MessageID, when set, is messaging.message.id.
	MessageID string
	// Attributes are added to the conventions' attributes.
	Attributes []attribute.KeyValue
}

// Destination is the span's messaging.destination.name: the exchange, or
// DefaultExchange for "".
func (p Publish) Destination() string {
	if p.Exchange == "" {
		return DefaultExchange
	}
	return p.Exchange
}

// publishAttributes are the conventions' attributes that every publish
// span has, built once.
var publishAttributes = trace.WithAttributes(
	attribute.String("messaging.system", "rabbitmq"),
	attribute.String("messaging.operation.type", "send"),
	attribute.String("messaging.operation.name", "publish"),
)

// StartPublish starts the producer span of p as a child of ctx's span. The
// span starts with the system, the operation and the destination (what a
// sampler may decide by); the routing key, the message id and
// p.Attributes are set when the span records, so that a process that does
// not trace allocates none of them per message.
func StartPublish(ctx context.Context, tracer trace.Tracer, p Publish) (context.Context, trace.Span) {
	dest := p.Destination()
	name := p.Name
	if name == "" {
		name = dest + " publish"
	}
	ctx, span := tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindProducer), publishAttributes,
		trace.WithAttributes(attribute.String("messaging.destination.name", dest)))
	if !span.IsRecording() {
		return ctx, span
	}
	if p.RoutingKey != "" {
		span.SetAttributes(attribute.String("messaging.rabbitmq.destination.routing_key", p.RoutingKey))
	}
	if p.MessageID != "" {
		span.SetAttributes(attribute.String("messaging.message.id", p.MessageID))
	}
	span.SetAttributes(p.Attributes...)
	return ctx, span
}

// Headers adapts amqp.Table to OpenTelemetry's TextMapCarrier: a
// propagator reads string (and byte-string) headers and writes strings.
type Headers amqp.Table

// Get returns the header key as a string ("" when absent or not a string).
func (h Headers) Get(key string) string {
	s, _ := wire.String(amqp.Table(h)[key])
	return s
}

// Set sets the header key to value.
func (h Headers) Set(key, value string) { h[key] = value }

// Keys returns the header names.
func (h Headers) Keys() []string {
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	return keys
}
