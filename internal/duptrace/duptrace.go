// Package duptrace owns how a suppressed duplicate shows in a trace: a link
// to the span that first processed its key (the trace and span ids the key
// row stores) and an event, the same for a message the consumer suppresses
// and for an HTTP request the middleware answers from the store.
package duptrace

import (
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/dedup"
)

// Event is the name of the event a duplicate's span gets.
const Event = "idemq.duplicate_suppressed"

// Mark adds to span, the span of a duplicate of rec's key, a link to the
// span that processed the key (link attribute idemq.link=duplicate_of;
// none when the row stores no valid ids) and the event Event with the
// original's trace id and completion time.
func Mark(span trace.Span, rec *dedup.Record) {
	attrs := []attribute.KeyValue{attribute.String("idemq.original.trace_id", rec.TraceID)}
	if rec.CompletedAt != nil {
		attrs = append(attrs, attribute.String("idemq.original.completed_at", rec.CompletedAt.UTC().Format(time.RFC3339Nano)))
	}
	tid, terr := trace.TraceIDFromHex(rec.TraceID)
	sid, serr := trace.SpanIDFromHex(rec.SpanID)
	if terr == nil && serr == nil {
		link := trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, Remote: true})
		span.AddLink(trace.Link{SpanContext: link, Attributes: []attribute.KeyValue{attribute.String("idemq.link", "duplicate_of")}})
	}
	span.AddEvent(Event, trace.WithAttributes(attrs...))
}
