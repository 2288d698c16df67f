package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/consumer/internal/kit"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/duptrace"
	"github.com/idemq/idemq/internal/msgspan"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/internal/wire"
)

// item is one delivery on its way to an outcome.
type item struct {
	d       *amqp.Delivery
	ctx     context.Context // carries the process span
	span    trace.Span
	start   time.Time
	attempt int
	// verified: d is a copy idemq signed, whose x-idemq-* headers are trusted.
	verified bool
	ev       Event
	claim    dedup.Claim
	lease    *dedup.Lease
	del      *Delivery // &delivery once the key is acquired
	delivery Delivery  // one allocation with the item
	// hctx is the context of the item's handler: it ends with
	// errLeaseLostByBeat when the heartbeat finds the lease lost (hcancel).
	hctx    context.Context
	hcancel context.CancelCauseFunc
	// order is its place in its ordering key's order (an ordered
	// consumer's delivery with an ordering key; nil otherwise).
	order *orderState
	// queued: the item runs again in a later unit (a repeat of a key of
	// its group, a whole group's item that runs again isolated), which
	// finishes it.
	queued bool
}

// begin checks whether d is a copy idemq signed (removing its x-idemq-*
// headers if not) and starts the delivery's process span.
func (c *Consumer) begin(ctx context.Context, d *amqp.Delivery) *item {
	verified, attempt := c.trust(d), 1
	if verified {
		attempt = wire.ParseAttempt(d.Headers)
	}
	parent := c.prop.Extract(ctx, c.traceCarrier(msgspan.Headers(d.Headers)))
	ctx, span := c.tracer.Start(parent, c.processSpan.name, c.processSpan.start...)
	if span.IsRecording() {
		span.SetAttributes(
			attribute.String("messaging.rabbitmq.destination.routing_key", d.RoutingKey),
			attribute.Int("messaging.message.body.size", len(d.Body)),
			attribute.Int("idemq.attempt", attempt))
	}
	return &item{d: d, ctx: ctx, span: span, start: time.Now(), attempt: attempt, verified: verified}
}

// processSpan is what every delivery's process span starts with: its name
// and the attributes that are the same for every delivery, built once, so
// that a consumer whose tracer records nothing allocates none of them per
// message (the attributes of each delivery are set when the span records).
type processSpan struct {
	name  string
	start []trace.SpanStartOption
}

func newProcessSpan(queue, name string) processSpan {
	return processSpan{name: queue + " process", start: []trace.SpanStartOption{
		trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(
			attribute.String("messaging.system", "rabbitmq"),
			attribute.String("messaging.operation.type", "process"),
			attribute.String("messaging.destination.name", queue),
			attribute.String(attrConsumer, name),
		),
	}}
}

// finish ends the span and reports the event.
func (c *Consumer) finish(it *item) {
	ev := it.ev
	ev.Attempt = it.attempt
	if sc := it.span.SpanContext(); sc.IsValid() {
		ev.TraceID = sc.TraceID().String()
	}
	ev.Duration = time.Since(it.start)
	if it.span.IsRecording() {
		it.span.SetAttributes(attribute.String("idemq.outcome", string(ev.Outcome)))
		if ev.Reason != "" {
			it.span.SetAttributes(attribute.String("idemq.reason", ev.Reason))
		}
		if ev.Err != nil && ev.Outcome != OutcomeRejected {
			it.span.SetStatus(codes.Error, redact.Error(ev.Err))
		}
	}
	it.span.End()
	c.metrics.deliveries.Add(it.ctx, 1, c.metrics.withLabel("outcome", string(ev.Outcome)))
	if c.cfg.OnOutcome != nil {
		c.cfg.OnOutcome(ev)
	}
	c.settled(it, ev.Outcome)
	if it.order != nil && it.order.gate != nil {
		it.order.gate.done(it, ev.Outcome)
	}
}

// prepare reads the key, tenant and fingerprint. A delivery that cannot be
// claimed is settled here (to the DLQ) and prepare returns false.
func (c *Consumer) prepare(s *session, it *item) bool {
	d := it.d
	if c.cfg.Ordering != nil {
		if err := c.readOrdering(s, it); err != nil {
			it.ev = Event{Outcome: OutcomeInvalidKey}
			c.deadLetter(s, it, ReasonSequenceInvalid, err)
			return false
		}
	}
	key, payload, err := c.identify(d)
	if err == nil {
		err = dedup.ValidateKey(key)
	}
	if err != nil {
		reason := ReasonKeyInvalid
		if errors.Is(err, dedup.ErrKeyRequired) {
			reason = ReasonKeyRequired
		}
		it.ev = Event{Outcome: OutcomeInvalidKey}
		c.deadLetter(s, it, reason, err)
		return false
	}
	tenant, err := c.tenantOf(d, it.verified)
	if err != nil {
		it.ev = Event{Outcome: OutcomeInvalidKey}
		c.deadLetter(s, it, ReasonKeyInvalid, err)
		return false
	}
	scope := dedup.Scope{Consumer: c.cfg.Name, Tenant: tenant, Key: key}
	it.ev = Event{KeyHash: scope.KeyHash(), Tenant: tenant, scoped: true}
	if it.span.IsRecording() {
		it.span.SetAttributes(attribute.String("idemq.key_hash", it.ev.KeyHash), attribute.String("idemq.tenant", tenant))
		if d.MessageId != "" && (c.cfg.LogKeys || d.MessageId != key) {
			it.span.SetAttributes(attribute.String("messaging.message.id", d.MessageId))
		}
		if c.cfg.LogKeys {
			it.span.SetAttributes(attribute.String("idemq.key", key))
		}
	}
	fp, err := c.cfg.Fingerprint(payload)
	if err != nil {
		c.deadLetter(s, it, ReasonPermanentError, fmt.Errorf("fingerprint: %w", err))
		return false
	}
	var traceID, spanID string
	if sc := it.span.SpanContext(); sc.IsValid() {
		traceID, spanID = sc.TraceID().String(), sc.SpanID().String()
	}
	it.claim = dedup.Claim{
		Scope: scope, Fingerprint: fp,
		TraceID: traceID, SpanID: spanID, Lease: c.cfg.Lease,
	}
	return true
}

// decide settles a reservation that did not acquire the key (duplicate,
// busy, key reuse) and returns false; for an acquired key it prepares the
// handler's view of the delivery and returns true.
func (c *Consumer) decide(s *session, it *item, res dedup.Reservation) bool {
	switch res.Decision {
	case dedup.Duplicate:
		it.ev.Outcome = OutcomeDuplicate
		it.ev.OriginalTraceID = res.Record.TraceID
		if r := res.Record.Result; r != nil && r.Outcome == dedup.OutcomeRejected {
			it.ev.RejectReason = r.Reason
		}
		duptrace.Mark(it.span, res.Record)
		it.ev.ReplyErr = c.reply(s, it, res.Record.Result)
		c.ack(s, it)
		return false
	case dedup.Busy:
		it.ev.Outcome = OutcomeInProgress
		// Come back when the lease ends, but look again within busyRecheck:
		// the holder usually finishes long before its lease would expire.
		wait := min(time.Until(derefTime(res.Record.LockedUntil)), busyRecheck)
		c.retryLater(s, it, c.topo.tierAtLeast(wait), nil)
		return false
	case dedup.KeyReuse:
		it.ev.Outcome = OutcomeKeyReuse
		c.deadLetter(s, it, ReasonKeyReuse, dedup.ErrKeyReuse)
		return false
	}
	c.acquire(it, res.Lease)
	return true
}

// acquire prepares the handler's view of an item whose key it holds.
func (c *Consumer) acquire(it *item, lease *dedup.Lease) {
	d := it.d
	it.lease = lease
	origExchange, origRoutingKey := wire.Origin(d)
	it.delivery = Delivery{
		Key: it.claim.Key, Tenant: it.claim.Tenant, Attempt: it.attempt,
		Body: d.Body, Headers: d.Headers, MessageID: d.MessageId, ContentType: d.ContentType,
		CorrelationID: d.CorrelationId, ReplyTo: d.ReplyTo, Exchange: d.Exchange, RoutingKey: d.RoutingKey,
		Timestamp: d.Timestamp, ContentEncoding: d.ContentEncoding, DeliveryMode: d.DeliveryMode, Priority: d.Priority,
		Expiration: d.Expiration, Type: d.Type, UserID: d.UserId, AppID: d.AppId,
		OriginalExchange: origExchange, OriginalRoutingKey: origRoutingKey,
		lease: lease, store: c.store, order: it.order,
	}
	it.del = &it.delivery
	if c.crash != nil {
		it.del.crash = func(stage kit.Stage, step string, txs ...pgx.Tx) { c.crashAt(stage, step, []*item{it}, txs...) }
	}
}

func derefTime(t *time.Time) time.Time {
	if t == nil {
		return time.Time{}
	}
	return *t
}
