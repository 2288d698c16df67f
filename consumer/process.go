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

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/confirm"
	"github.com/idemq/idemq/internal/header"
	"github.com/idemq/idemq/internal/redact"
)

// settleTimeout bounds the broker writes that settle a delivery after its
// handler (the replacing copy, the reply), even when the handler's context
// is gone. Key-store calls are bounded by Config.StoreTimeout.
const settleTimeout = 30 * time.Second

// busyRecheck bounds how long a copy that found its key busy waits before
// it looks again.
const busyRecheck = 5 * time.Second

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
	del      *Delivery
}

// begin checks whether d is a copy idemq signed (removing its x-idemq-*
// headers if not) and starts the delivery's process span.
func (c *Consumer) begin(ctx context.Context, d *amqp.Delivery) *item {
	verified, attempt := c.trust(d), 1
	if verified {
		attempt = ParseAttempt(d.Headers)
	}
	parent := c.prop.Extract(ctx, headerCarrier(d.Headers))
	ctx, span := c.tracer.Start(parent, c.cfg.Queue+" process",
		trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(
			attribute.String("messaging.system", "rabbitmq"),
			attribute.String("messaging.operation.type", "process"),
			attribute.String("messaging.destination.name", c.cfg.Queue),
			attribute.String("messaging.rabbitmq.destination.routing_key", d.RoutingKey),
			attribute.String("messaging.consumer.group.name", c.cfg.Name),
			attribute.Int("messaging.message.body.size", len(d.Body)),
			attribute.Int("idemq.attempt", attempt),
		))
	return &item{d: d, ctx: ctx, span: span, start: time.Now(), attempt: attempt, verified: verified}
}

// finish ends the span and reports the event.
func (c *Consumer) finish(it *item) {
	ev := it.ev
	ev.Attempt = it.attempt
	if sc := it.span.SpanContext(); sc.IsValid() {
		ev.TraceID = sc.TraceID().String()
	}
	ev.Duration = time.Since(it.start)
	it.span.SetAttributes(attribute.String("idemq.outcome", string(ev.Outcome)))
	if ev.Reason != "" {
		it.span.SetAttributes(attribute.String("idemq.reason", ev.Reason))
	}
	if ev.Err != nil && ev.Outcome != OutcomeRejected {
		it.span.SetStatus(codes.Error, redact.Error(ev.Err))
	}
	it.span.End()
	c.metrics.deliveries.Add(it.ctx, 1, c.metrics.with(attribute.String("outcome", string(ev.Outcome))))
	if c.cfg.OnOutcome != nil {
		c.cfg.OnOutcome(ev)
	}
}

// process takes one delivery to exactly one outcome, and acks it only after
// whatever replaces it is durable.
func (c *Consumer) process(ctx context.Context, s *session, d *amqp.Delivery) {
	it := c.begin(ctx, d)
	defer func() {
		s.flush()
		c.finish(it)
	}()
	if !c.prepare(s, it) {
		return
	}
	rctx, cancel := c.storeCtx(it.ctx)
	defer cancel()
	rctx, rspan := c.tracer.Start(rctx, "idemq reserve")
	t0 := time.Now()
	res, err := c.store.Reserve(rctx, it.claim)
	c.metrics.reserveTime.Record(it.ctx, time.Since(t0).Seconds(), c.metrics.with())
	if err != nil {
		rspan.SetStatus(codes.Error, redact.Error(err))
		rspan.End()
		// The key store is unreachable: an infrastructure failure.
		it.ev = c.retryOrDeadLetter(it.ctx, s, d, it.ev, it.attempt, fmt.Errorf("reserve: %w", err))
		return
	}
	rspan.SetAttributes(attribute.String("idemq.decision", res.Decision.String()))
	rspan.End()
	if !c.decide(s, it, res) {
		return
	}
	it.ev = c.handle(it.ctx, s, d, it.ev, it.attempt, it.del, it.lease)
}

// prepare reads the key, tenant and fingerprint. A delivery that cannot be
// claimed is settled here (to the DLQ) and prepare returns false.
func (c *Consumer) prepare(s *session, it *item) bool {
	ctx, d := it.ctx, it.d
	key, err := ExtractKey(d, c.cfg.KeyFunc, c.cfg.KeyHeader)
	if err == nil {
		err = dedup.ValidateKey(key)
	}
	if err != nil {
		reason := ReasonKeyInvalid
		if errors.Is(err, dedup.ErrKeyRequired) {
			reason = ReasonKeyRequired
		}
		it.ev = c.deadLetter(ctx, s, d, Event{Outcome: OutcomeInvalidKey}, reason, err, it.attempt)
		return false
	}
	tenant, err := c.tenantOf(d, it.verified)
	if err != nil {
		it.ev = c.deadLetter(ctx, s, d, Event{Outcome: OutcomeInvalidKey}, ReasonKeyInvalid, err, it.attempt)
		return false
	}
	it.ev = Event{KeyHash: dedup.KeyHash(c.cfg.Name, tenant, key), Tenant: tenant, scoped: true}
	it.span.SetAttributes(attribute.String("idemq.key_hash", it.ev.KeyHash), attribute.String("idemq.tenant", tenant))
	if d.MessageId != "" && (c.cfg.LogKeys || d.MessageId != key) {
		it.span.SetAttributes(attribute.String("messaging.message.id", d.MessageId))
	}
	if c.cfg.LogKeys {
		it.span.SetAttributes(attribute.String("idemq.key", key))
	}
	fp, err := c.cfg.Fingerprint(d.Body)
	if err != nil {
		it.ev = c.deadLetter(ctx, s, d, it.ev, ReasonPermanentError, fmt.Errorf("fingerprint: %w", err), it.attempt)
		return false
	}
	var traceID, spanID string
	if sc := it.span.SpanContext(); sc.IsValid() {
		traceID, spanID = sc.TraceID().String(), sc.SpanID().String()
	}
	it.claim = dedup.Claim{
		Consumer: c.cfg.Name, Tenant: tenant, Key: key, Fingerprint: fp,
		TraceID: traceID, SpanID: spanID, Lease: c.cfg.Lease,
	}
	return true
}

// decide settles a reservation that did not acquire the key (duplicate,
// busy, key reuse) and returns false; for an acquired key it prepares the
// handler's view of the delivery and returns true.
func (c *Consumer) decide(s *session, it *item, res dedup.Reservation) bool {
	ctx, d := it.ctx, it.d
	switch res.Decision {
	case dedup.Duplicate:
		it.ev.Outcome = OutcomeDuplicate
		it.ev.OriginalTraceID = res.Record.TraceID
		c.markDuplicate(ctx, it.span, res.Record)
		it.ev.ReplyErr = c.reply(ctx, s, d, res.Record.Result)
		it.ev = c.ack(s, d, it.ev)
		return false
	case dedup.Busy:
		it.ev.Outcome = OutcomeInProgress
		// Come back when the lease ends, but look again within busyRecheck:
		// the holder usually finishes long before its lease would expire.
		wait := min(time.Until(derefTime(res.Record.LockedUntil)), busyRecheck)
		it.ev = c.retryLater(ctx, s, d, it.ev, it.attempt, c.topo.TierAtLeast(wait), nil)
		return false
	case dedup.KeyReuse:
		it.ev.Outcome = OutcomeKeyReuse
		it.ev = c.deadLetter(ctx, s, d, it.ev, ReasonKeyReuse, errors.New("key reused with another fingerprint"), it.attempt)
		return false
	}
	it.lease = res.Lease
	origExchange, origRoutingKey := origin(d)
	it.del = &Delivery{
		Key: it.claim.Key, Tenant: it.claim.Tenant, Attempt: it.attempt,
		Body: d.Body, Headers: d.Headers, MessageID: d.MessageId, ContentType: d.ContentType,
		CorrelationID: d.CorrelationId, ReplyTo: d.ReplyTo, Exchange: d.Exchange, RoutingKey: d.RoutingKey,
		Timestamp: d.Timestamp, ContentEncoding: d.ContentEncoding, DeliveryMode: d.DeliveryMode, Priority: d.Priority,
		Expiration: d.Expiration, Type: d.Type, UserID: d.UserId, AppID: d.AppId,
		OriginalExchange: origExchange, OriginalRoutingKey: origRoutingKey,
		lease: res.Lease, store: c.store,
	}
	return true
}

// markDuplicate links the duplicate's span to the processing it duplicated.
func (c *Consumer) markDuplicate(ctx context.Context, span trace.Span, rec *dedup.Record) {
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
	span.AddEvent("idemq.duplicate_suppressed", trace.WithAttributes(attrs...))
}

// handle runs the handler for an acquired key and settles the outcome.
func (c *Consumer) handle(ctx context.Context, s *session, d *amqp.Delivery, ev Event, attempt int, del *Delivery, lease *dedup.Lease) Event {
	c.inFlight.Add(1)
	c.metrics.inProgress.Add(ctx, 1, c.metrics.with())
	defer func() {
		c.inFlight.Add(-1)
		c.metrics.inProgress.Add(context.WithoutCancel(ctx), -1, c.metrics.with())
	}()
	hctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	hctx, cancelTimeout := context.WithTimeoutCause(hctx, c.cfg.HandlerTimeout, errHandlerTimeout)
	defer cancelTimeout()
	if !c.cfg.DisableHeartbeat {
		stop := c.heartbeat(hctx, lease, cancel)
		defer stop()
	}

	t0 := time.Now()
	result, herr := c.runInTx(hctx, del, lease)
	c.metrics.handlerTime.Record(ctx, time.Since(t0).Seconds(), c.metrics.with())
	if herr == nil {
		if result.Outcome == dedup.OutcomeRejected {
			ev.Outcome = OutcomeRejected
		} else {
			ev.Outcome = OutcomeProcessed
		}
		ev.ReplyErr = c.reply(ctx, s, d, &result)
		return c.ack(s, d, ev)
	}
	if cause := context.Cause(hctx); cause != nil && !errors.Is(herr, cause) {
		herr = fmt.Errorf("%w (%w)", herr, cause)
	}
	return c.settleFailure(ctx, s, d, ev, attempt, lease, herr, false)
}

// settleFailure routes a handler run that did not commit: a lost lease comes
// back later; otherwise the key is released (unless lease is nil: the
// caller released it) and the message goes to the DLQ (permanent), or to a
// retry tier. bystander marks a run that failed only because a batch-mate
// broke the shared transaction: it retries without counting an attempt.
func (c *Consumer) settleFailure(ctx context.Context, s *session, d *amqp.Delivery, ev Event, attempt int, lease *dedup.Lease, herr error, bystander bool) Event {
	ev.Err = herr
	if errors.Is(herr, dedup.ErrLeaseLost) {
		// Another worker owns the key now; its outcome stands. Come back
		// later: by then the key is completed (a duplicate) or free again.
		ev.Outcome = OutcomeLeaseLost
		return c.retryLater(ctx, s, d, ev, attempt, c.topo.TierFor(1), herr)
	}
	// Release the key now so the retry takes it over without waiting for the lease.
	if lease != nil {
		sctx, scancel := c.storeCtx(context.WithoutCancel(ctx))
		defer scancel()
		if err := c.store.Release(sctx, lease); err != nil && !errors.Is(err, dedup.ErrLeaseLost) {
			c.log.Warn("release key failed; the lease will expire", "key_hash", ev.KeyHash, "err", redact.Error(err))
		}
	}
	switch {
	case IsPermanent(herr):
		return c.deadLetter(ctx, s, d, ev, ReasonPermanentError, herr, attempt)
	case bystander:
		ev.Outcome = OutcomeRetried
		return c.retryLater(ctx, s, d, ev, attempt, c.topo.TierFor(1), herr)
	}
	return c.retryOrDeadLetter(ctx, s, d, ev, attempt, herr)
}

var (
	errHandlerTimeout  = errors.New("handler timeout")
	errLeaseLostByBeat = fmt.Errorf("heartbeat: %w", dedup.ErrLeaseLost)
)

// heartbeat extends the lease every lease/3 until stopped; when the lease is
// lost it cancels the handler with ErrLeaseLost as the cause. Each extend is
// bounded by the period (the next one takes over), and stop cancels the one
// in flight rather than wait for it.
func (c *Consumer) heartbeat(ctx context.Context, lease *dedup.Lease, cancel context.CancelCauseFunc) (stop func()) {
	period := beatPeriod(lease)
	ctx, endBeats := context.WithCancel(ctx)
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		t := time.NewTicker(period)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				bctx, bcancel := context.WithTimeout(ctx, period)
				err := c.store.Extend(bctx, lease, c.cfg.Lease)
				bcancel()
				if errors.Is(err, dedup.ErrLeaseLost) {
					cancel(errLeaseLostByBeat)
					return
				}
				if err != nil && ctx.Err() == nil {
					c.log.Warn("lease heartbeat failed", "err", redact.Error(err))
				}
			}
		}
	}()
	return func() { endBeats(); <-finished }
}

// beatPeriod is a third of what is left of the lease (1s if nothing is).
func beatPeriod(l *dedup.Lease) time.Duration {
	if p := time.Until(l.LockedUntil) / 3; p > 0 {
		return p
	}
	return time.Second
}

// storeCtx bounds one key-store call the runtime makes on its own behalf
// by StoreTimeout.
func (c *Consumer) storeCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, c.cfg.StoreTimeout)
}

// rollback rolls tx back, bounded by StoreTimeout, even when ctx is gone.
// On a dead connection pgx closes it instead; either way nothing commits.
func (c *Consumer) rollback(ctx context.Context, tx pgx.Tx) {
	rctx, cancel := c.storeCtx(context.WithoutCancel(ctx))
	defer cancel()
	_ = tx.Rollback(rctx)
}

// runInTx runs the handler in a transaction and, unless it failed, completes
// the key in that transaction and commits. A nil error means committed.
func (c *Consumer) runInTx(ctx context.Context, del *Delivery, lease *dedup.Lease) (result dedup.Result, err error) {
	hctx, hspan := c.tracer.Start(ctx, "idemq handler")
	tx, err := c.store.Pool().Begin(hctx)
	if err != nil {
		hspan.End()
		return result, fmt.Errorf("begin: %w", err)
	}
	defer func() {
		if err != nil {
			c.rollback(ctx, tx)
		}
	}()
	hctx = c.withClaim(hctx, del)
	resp, herr := c.safeCall(hctx, tx, del)
	result, serr := storedResult(resp, herr)
	if serr != nil {
		hspan.SetStatus(codes.Error, redact.Error(serr))
		hspan.End()
		return result, serr
	}
	if rej := (*RejectError)(nil); errors.As(herr, &rej) {
		hspan.SetAttributes(attribute.String("idemq.reject_reason", rej.Reason))
	}
	hspan.End()

	cctx, cspan := c.tracer.Start(ctx, "idemq complete")
	defer cspan.End()
	if err := c.store.Complete(cctx, tx, lease, result); err != nil {
		cspan.SetStatus(codes.Error, redact.Error(err))
		return result, err
	}
	if err := tx.Commit(cctx); err != nil {
		// The commit's fate is unknown: release (a no-op if it did commit)
		// and retry; the retry is a duplicate if it committed.
		cspan.SetStatus(codes.Error, redact.Error(err))
		return result, fmt.Errorf("commit: %w", err)
	}
	return result, nil
}

// safeCall runs the handler, turning a panic into an infrastructure failure.
func (c *Consumer) safeCall(ctx context.Context, tx pgx.Tx, del *Delivery) (resp Response, err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &PanicError{Value: v}
		}
	}()
	return c.handler(ctx, tx, del)
}

// retryOrDeadLetter sends a failed delivery to the next retry tier, or to
// the DLQ once MaxAttempts is reached.
func (c *Consumer) retryOrDeadLetter(ctx context.Context, s *session, d *amqp.Delivery, ev Event, attempt int, cause error) Event {
	ev.Err = cause
	if attempt >= c.cfg.MaxAttempts {
		return c.deadLetter(ctx, s, d, ev, ReasonMaxAttemptsExceeded, cause, attempt)
	}
	ev.Outcome = OutcomeRetried
	ev, ok := c.publishThenAck(ctx, s, d, ev, "", c.topo.TierFor(attempt), RetryHeaders(attempt+1), "idemq retry publish")
	if ok {
		c.metrics.retries.Add(ctx, 1, c.metrics.with())
	}
	return ev
}

// retryLater sends the delivery through a delay tier without counting an
// attempt (busy key, lost lease).
func (c *Consumer) retryLater(ctx context.Context, s *session, d *amqp.Delivery, ev Event, attempt int, tier string, cause error) Event {
	ev.Err = cause
	ev, _ = c.publishThenAck(ctx, s, d, ev, "", tier, RetryHeaders(attempt), "idemq retry publish")
	return ev
}

// deadLetter publishes a copy to Q.dlx with the reason headers, then acks.
// It is counted and logged as dead-lettered only once the broker confirmed
// the copy.
func (c *Consumer) deadLetter(ctx context.Context, s *session, d *amqp.Delivery, ev Event, reason string, cause error, attempt int) Event {
	if ev.Outcome == "" || ev.Outcome == OutcomeRetried {
		ev.Outcome = OutcomeDeadLettered
	}
	ev.Reason, ev.Err = reason, cause
	ev, ok := c.publishThenAck(ctx, s, d, ev, c.topo.DLX, "", DeadLetterHeaders(reason, cause, attempt), "idemq dlq publish")
	if ok {
		c.metrics.deadLetters.Add(ctx, 1, c.metrics.with(attribute.String("reason", reason)))
		c.log.Warn("dead-lettered", "reason", reason, "key_hash", ev.KeyHash, "attempt", attempt, "err", redact.Error(cause))
	}
	return ev
}

// copyFailedPause is how long a delivery whose replacing copy could not be
// made durable is held before it goes back to its queue, so that a broken
// route (a deleted tier or DLQ) does not turn into a redelivery loop at full
// speed.
const copyFailedPause = time.Second

// publishThenAck publishes the copy that replaces d and acks d once the
// broker confirmed the copy (ok). If the copy cannot be made durable
// (unroutable, nacked, not confirmed in time, channel closed), d goes back
// to its queue instead (nack with requeue), never dropped, and the outcome
// is OutcomeCopyFailed.
func (c *Consumer) publishThenAck(ctx context.Context, s *session, d *amqp.Delivery, ev Event, exchange, key string, headers amqp.Table, spanName string) (_ Event, ok bool) {
	msg := c.replacement(d, ev, headers)
	pctx, span := c.tracer.Start(ctx, spanName, trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(attribute.String("messaging.system", "rabbitmq"),
			attribute.String("messaging.operation.type", "publish"),
			attribute.String("messaging.destination.name", exchange+key)))
	c.prop.Inject(pctx, headerCarrier(msg.Headers))
	budget := s.pub.FrameMax()
	if budget > 0 && exchange != c.topo.DLX {
		// A retry copy comes back through the broker's dead-lettering,
		// which adds headers of its own.
		budget -= c.deathReserve
	}
	tooLarge := !trimToFit(&msg, budget)
	if tooLarge {
		// Even trimmed, the copy would not fit in one frame (sending it would
		// make the broker close the connection): dead-letter it with the
		// headers it can carry.
		tooLargeCopy(&msg, s.pub.FrameMax(), ParseAttempt(headers))
		exchange, key = c.topo.DLX, ""
		ev.Outcome, ev.Reason = OutcomeDeadLettered, ReasonHeadersTooLarge
		span.SetAttributes(attribute.String("idemq.reason", ReasonHeadersTooLarge))
	}
	// Trimming may have dropped signed headers: sign what is left (the
	// signature's size does not change).
	c.keys.Sign(msg.Headers, msg.MessageId, msg.Body, time.Now())
	sctx, cancel := context.WithTimeout(context.WithoutCancel(pctx), c.cfg.PublishTimeout)
	defer cancel()
	err := s.pub.PublishWait(sctx, exchange, key, msg)
	if err != nil {
		span.SetStatus(codes.Error, redact.Error(err))
		span.End()
		c.log.Error("the copy that replaces the message is not durable; returning the message to its queue",
			"intended", string(ev.Outcome), "reason", ev.Reason, "exchange", exchange, "routing_key", key,
			"key_hash", ev.KeyHash, "err", redact.Error(err))
		ev.Outcome, ev.Err = OutcomeCopyFailed, fmt.Errorf("%s to %q/%q: %w", spanName, exchange, key, err)
		if !errors.Is(err, confirm.ErrClosed) {
			select {
			case <-s.stop:
			case <-time.After(copyFailedPause):
			}
		}
		s.nack(d)
		return ev, false
	}
	span.End()
	if tooLarge {
		c.metrics.deadLetters.Add(ctx, 1, c.metrics.with(attribute.String("reason", ReasonHeadersTooLarge)))
		c.log.Warn("dead-lettered", "reason", ReasonHeadersTooLarge, "key_hash", ev.KeyHash, "err", msg.Headers[HeaderError])
		return c.ack(s, d, ev), false
	}
	return c.ack(s, d, ev), true
}

// ack settles d once its outcome is durable: at once, or through the
// session's ack window, which coalesces acks into multiple-acks.
func (c *Consumer) ack(s *session, d *amqp.Delivery, ev Event) Event {
	if s.acks != nil {
		s.acks.ready(d.DeliveryTag)
		return ev
	}
	if err := d.Ack(false); err != nil {
		// The channel is gone: the broker redelivers, and the key makes the
		// redelivery harmless.
		c.log.Warn("ack failed; the message will be redelivered", "key_hash", ev.KeyHash, "err", redact.Error(err))
	}
	return ev
}

// reply sends the stored response to reply_to, when the message asks for one.
// Best effort: a lost reply is recovered by resending the request, which
// gets the stored response again.
func (c *Consumer) reply(ctx context.Context, s *session, d *amqp.Delivery, r *dedup.Result) error {
	if d.ReplyTo == "" || r == nil || c.cfg.NoReply {
		return nil
	}
	msg := amqp.Publishing{
		CorrelationId: d.CorrelationId,
		MessageId:     d.MessageId,
		DeliveryMode:  amqp.Persistent,
		Body:          r.Response,
		Headers:       amqp.Table{header.Outcome: string(r.Outcome), header.ResponseCode: int32(r.Code)},
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.PublishTimeout)
	defer cancel()
	if err := s.pub.PublishWait(sctx, "", d.ReplyTo, msg); err != nil {
		c.metrics.repliesFailed.Add(ctx, 1, c.metrics.with())
		c.log.Warn("reply not delivered; the requester gets the stored result again if it resends", "err", redact.Error(err))
		return fmt.Errorf("reply to %s: %w", d.ReplyTo, err)
	}
	return nil
}

func derefTime(t *time.Time) time.Time {
	if t == nil {
		return time.Time{}
	}
	return *t
}
