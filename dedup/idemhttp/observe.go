package idemhttp

import (
	"context"
	"fmt"
	"net/http"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/propagator"
)

// instrumentation is the name of the tracer and meter.
const instrumentation = "github.com/idemq/idemq/dedup/idemhttp"

// The outcomes of a guarded request: the attribute idemq.outcome of its
// span and outcome of the counter idemq.http.requests. They are the
// protocol's one vocabulary (dedup.Outcome), which the consumer's deliveries
// share: the same word for the same situation.
const (
	OutcomeProcessed  = dedup.OutcomeProcessed  // the handler ran; its response is stored
	OutcomeRejected   = dedup.OutcomeRejected   // the same, with a 4xx stored as the result (a declined card)
	OutcomeDuplicate  = dedup.OutcomeDuplicate  // answered from the store, nothing ran
	OutcomeNotStored  = dedup.OutcomeNotStored  // the handler's response is no result (Config.Stored, Discard)
	OutcomeInProgress = dedup.OutcomeInProgress // 409: the key is being processed
	OutcomeKeyReuse   = dedup.OutcomeKeyReuse   // 422: the key names another request
	OutcomeInvalidKey = dedup.OutcomeInvalidKey // 400: no key, or not a valid one
	OutcomeLeaseLost  = dedup.OutcomeLeaseLost  // 409: another request took the key over
	OutcomeRefused    = dedup.OutcomeRefused    // refused before its key was reserved (body, tenant)
	OutcomeFailed     = dedup.OutcomeFailed     // infrastructure failure, timeout or panic: key released
)

// outcomeOf is the outcome of a request answered with problem code.
func outcomeOf(code string) dedup.Outcome {
	switch code {
	case CodeKeyRequired, CodeKeyInvalid:
		return OutcomeInvalidKey
	case CodeKeyInProgress:
		return OutcomeInProgress
	case CodeKeyReuse:
		return OutcomeKeyReuse
	case CodeLeaseLost:
		return OutcomeLeaseLost
	case CodeBodyTooLarge, CodeBodyUnreadable, CodeUnauthenticated, CodeTenantInvalid:
		return OutcomeRefused
	}
	return OutcomeFailed
}

// telemetry is the middleware's tracer and counter.
type telemetry struct {
	tracer   trace.Tracer
	requests metric.Int64Counter
}

func newTelemetry(c Config) (telemetry, error) {
	requests, err := c.MeterProvider.Meter(instrumentation).Int64Counter("idemq.http.requests",
		metric.WithDescription("Guarded requests answered, by outcome"), metric.WithUnit("{request}"))
	if err != nil {
		return telemetry{}, fmt.Errorf("counter idemq.http.requests: %w", err)
	}
	return telemetry{tracer: c.TracerProvider.Tracer(instrumentation), requests: requests}, nil
}

// observed is the writer of a guarded request: it remembers what the
// middleware answered, for the span and the counter.
type observed struct {
	http.ResponseWriter
	status  int
	outcome dedup.Outcome
	code    string // the problem code, when the answer was a problem
	span    trace.Span
}

func (o *observed) WriteHeader(status int) {
	if o.status == 0 && !informational(status) {
		o.status = status
	}
	o.ResponseWriter.WriteHeader(status)
}

// Unwrap lets http.ResponseController reach the connection's writer.
func (o *observed) Unwrap() http.ResponseWriter { return o.ResponseWriter }

// settled records the outcome of the request w answers, when w is a
// guarded request's writer.
func settled(w http.ResponseWriter, outcome dedup.Outcome) {
	if o, ok := w.(*observed); ok {
		o.outcome = outcome
	}
}

// answeredProblem records the problem code w answered with.
func answeredProblem(w http.ResponseWriter, code string) {
	if o, ok := w.(*observed); ok {
		o.code = code
	}
}

// observe starts the span of a guarded request and returns the writer and
// request to go on with, and end, which closes the span and counts the
// request (deferred: it also runs when the handler aborts the request).
func (m *Middleware) observe(w http.ResponseWriter, r *http.Request) (*observed, *http.Request, func()) {
	ctx := r.Context()
	if !trace.SpanContextFromContext(ctx).IsValid() {
		ctx = propagator.Or(m.cfg.Propagator).Extract(ctx, propagation.HeaderCarrier(r.Header))
	}
	ctx, span := m.tel.tracer.Start(ctx, "idemq request",
		trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithAttributes(attribute.String("idemq.consumer", m.cfg.Consumer), attribute.String("http.request.method", r.Method)))
	o := &observed{ResponseWriter: w, span: span}
	return o, r.WithContext(ctx), func() {
		outcome := o.outcome
		if outcome == "" {
			outcome = outcomeOf(o.code)
		}
		attrs := []attribute.KeyValue{attribute.String("idemq.outcome", string(outcome))}
		if o.code != "" {
			attrs = append(attrs, attribute.String("idemq.reason", o.code))
		}
		if o.status != 0 {
			span.SetAttributes(attribute.Int("http.response.status_code", o.status))
		}
		span.SetAttributes(attrs...)
		if outcome == OutcomeFailed {
			span.SetStatus(codes.Error, o.code)
		}
		span.End()
		m.tel.requests.Add(context.WithoutCancel(ctx), 1, metric.WithAttributes(
			attribute.String("idemq.consumer", m.cfg.Consumer), attribute.String("outcome", string(outcome))))
	}
}

// keyed names the request's key on its span: its hash and tenant, never
// the key itself.
func keyed(w http.ResponseWriter, sc dedup.Scope) {
	if o, ok := w.(*observed); ok {
		o.span.SetAttributes(attribute.String("idemq.key_hash", sc.KeyHash()), attribute.String("idemq.tenant", sc.Tenant))
	}
}
