package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/confirm"
	"github.com/idemq/idemq/internal/msgspan"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/internal/wire"
)

// settleTimeout bounds the broker writes that settle a delivery after its
// handler (the replacing copy, the reply), even when the handler's context
// is gone. Key-store calls are bounded by Config.StoreTimeout.
const settleTimeout = 30 * time.Second

// busyRecheck bounds how long a copy that found its key busy waits before
// it looks again.
const busyRecheck = 5 * time.Second

// copyFailedPause is how long a delivery whose replacing copy could not be
// made durable is held before it goes back to its queue, so that a broken
// route (a deleted tier or DLQ) does not turn into a redelivery loop at full
// speed.
const copyFailedPause = time.Second

// settleSuccess settles an item whose effects and key completion committed:
// the stored result goes to reply_to (if asked), then the ack.
func (c *Consumer) settleSuccess(s *session, it *item, r *dedup.Result) {
	if it.order != nil && it.order.applied {
		// Its sequence was applied already (under another idempotency key):
		// nothing ran; its key is completed, so a redelivery is a plain
		// duplicate.
		it.ev.Outcome = OutcomeDuplicate
		c.ack(s, it)
		return
	}
	if r.Outcome == dedup.OutcomeRejected {
		it.ev.Outcome, it.ev.RejectReason = OutcomeRejected, r.Reason
	} else {
		it.ev.Outcome = OutcomeProcessed
	}
	it.ev.ReplyErr = c.reply(s, it, r)
	c.ack(s, it)
}

// settleFailure routes a handler run that did not commit (its key already
// released by releaseFailed): a lost lease comes back later; otherwise the
// message goes to the DLQ (permanent), or to a retry tier. A bystander (it
// failed only because a group-mate broke the shared transaction) retries
// without counting an attempt.
func (c *Consumer) settleFailure(s *session, it *item, herr error, bystander bool) {
	it.ev.Err = herr
	if early := (*errEarly)(nil); errors.As(herr, &early) && !IsPermanent(herr) && it.order != nil && it.order.gate != nil {
		if it.order.gate.reserve() {
			// It waits in the gate for its predecessor, unacknowledged.
			it.ev.Outcome = OutcomeWaiting
			return
		}
		// The waiting room is full: it waits in a retry tier.
		c.circle(s, it, early)
		return
	}
	if errors.Is(herr, errGap) {
		c.deadLetter(s, it, ReasonSequenceGap, herr)
		return
	}
	if !bystander {
		defer c.logFailure("handler failed", it, herr)
	}
	if errors.Is(herr, dedup.ErrLeaseLost) {
		// Another worker owns the key now; its outcome stands. Come back
		// later: by then the key is completed (a duplicate) or free again.
		it.ev.Outcome = OutcomeLeaseLost
		c.retryLater(s, it, c.topo.TierFor(1), herr)
		return
	}
	switch reason := c.releaseReason(it, herr, bystander); {
	case reason != string(OutcomeRetried):
		c.deadLetter(s, it, reason, herr)
	case bystander:
		it.ev.Outcome = OutcomeRetried
		c.retryLater(s, it, c.topo.TierFor(1), herr)
	default:
		c.retryOrDeadLetter(s, it, herr)
	}
}

// logFailure logs, once the delivery is routed and at most
// failureLogsPerSecond times a second, a failure that did not commit and
// was not dead-lettered (a dead letter has its one line, logDeadLetter): the
// outcome it got (retried, lease_lost, copy_failed), the reason (what
// failed: handler_error, handler_timeout, panic, lease_lost, reserve_error),
// the key hash (never the key), the attempt and the error. A line after
// suppressed ones says how many were suppressed.
func (c *Consumer) logFailure(msg string, it *item, err error) {
	if it.ev.Outcome == OutcomeDeadLettered {
		return
	}
	level := slog.LevelWarn
	if it.ev.Outcome == OutcomeCopyFailed {
		level = slog.LevelError
	}
	c.logLimited(it, level, msg, cmp.Or(it.ev.Reason, failureKind(err)), redact.Error(err), err)
}

// logDeadLetter logs the one line of a dead letter, at ERROR, once the
// broker confirmed its copy in the DLQ (at most failureLogsPerSecond lines
// a second, shared with logFailure): its reason, the key hash, the attempt
// and the error that sent it there (errText), with the panic's value and
// stack when a handler panicked (cause).
func (c *Consumer) logDeadLetter(it *item, reason, errText string, cause error) {
	c.logLimited(it, slog.LevelError, "dead-lettered", reason, errText, cause)
}

// logLimited writes a failure's line unless failLogs suppresses it.
func (c *Consumer) logLimited(it *item, level slog.Level, msg, reason, errText string, cause error) {
	ok, suppressed := c.failLogs.allow(time.Now())
	if !ok {
		return
	}
	attrs := []any{"outcome", string(it.ev.Outcome), "reason", reason, "key_hash", it.ev.KeyHash,
		"attempt", it.attempt, "max_attempts", c.cfg.MaxAttempts, "err", errText}
	if pe := (*PanicError)(nil); errors.As(cause, &pe) {
		attrs = append(attrs, "panic", fmt.Sprint(pe.Value), "stack", string(pe.Stack))
	}
	if suppressed > 0 {
		attrs = append(attrs, "suppressed", suppressed)
	}
	c.log.Log(it.ctx, level, msg, attrs...)
}

// failureKind names what failed, for the log of a failure that is not
// dead-lettered.
func failureKind(err error) string {
	switch {
	case errors.Is(err, dedup.ErrLeaseLost):
		return "lease_lost"
	case errors.Is(err, ErrHandlerTimeout):
		return "handler_timeout"
	case errors.As(err, new(*PanicError)):
		return "panic"
	case errors.Is(err, errReserve):
		return "reserve_error"
	}
	return "handler_error"
}

// releaseReason is where a failed run (its lease not lost) goes, in the
// word its key is released with: the dead-letter reason (permanent_error,
// max_attempts_exceeded), else the outcome retried. A bystander retries
// without counting an attempt.
func (c *Consumer) releaseReason(it *item, herr error, bystander bool) string {
	switch {
	case errors.Is(herr, errGap):
		return ReasonSequenceGap
	case errors.As(herr, new(*errEarly)):
		return string(OutcomeWaiting)
	case IsPermanent(herr):
		return ReasonPermanentError
	case bystander:
		return string(OutcomeRetried)
	case it.attempt >= c.cfg.MaxAttempts:
		return ReasonMaxAttemptsExceeded
	}
	return string(OutcomeRetried)
}

// retryOrDeadLetter sends a failed delivery to the next retry tier, or to
// the DLQ once MaxAttempts is reached.
func (c *Consumer) retryOrDeadLetter(s *session, it *item, cause error) {
	it.ev.Err = cause
	if it.attempt >= c.cfg.MaxAttempts {
		c.deadLetter(s, it, ReasonMaxAttemptsExceeded, cause)
		return
	}
	it.ev.Outcome = OutcomeRetried
	if c.publishThenAck(s, it, "", c.topo.TierFor(it.attempt), wire.RetryHeaders(it.attempt+1), "idemq retry publish") {
		c.metrics.retries.Add(it.ctx, 1, c.metrics.with())
	}
}

// retryLater sends the delivery through a delay tier without counting an
// attempt (busy key, lost lease, a group-mate's failure).
func (c *Consumer) retryLater(s *session, it *item, tier string, cause error) {
	it.ev.Err = cause
	c.publishThenAck(s, it, "", tier, wire.RetryHeaders(it.attempt), "idemq retry publish")
}

// deadLetter publishes a copy to Q.dlx with the reason headers, then acks.
// It is counted and logged as dead-lettered only once the broker confirmed
// the copy.
func (c *Consumer) deadLetter(s *session, it *item, reason string, cause error) {
	if it.ev.Outcome == "" || it.ev.Outcome == OutcomeRetried {
		it.ev.Outcome = OutcomeDeadLettered
	}
	it.ev.Reason, it.ev.Err = reason, cause
	c.blockKey(it, reason)
	if c.publishThenAck(s, it, c.topo.DLX, "", wire.DeadLetterHeaders(reason, cause, it.attempt), "idemq dlq publish") {
		c.metrics.deadLetters.Add(it.ctx, 1, c.metrics.withLabel("reason", reason))
		c.logDeadLetter(it, reason, redact.Error(cause), cause)
	}
}

// publishThenAck publishes the copy that replaces the delivery and acks the
// delivery once the broker confirmed the copy (ok). If the copy cannot be
// made durable (unroutable, nacked, not confirmed in time, channel closed),
// the delivery goes back to its queue instead (nack with requeue), never
// dropped, and the outcome is OutcomeCopyFailed. A copy that cannot fit in
// one frame is dead-lettered headers_too_large instead (ok is false: the
// intended copy did not go).
func (c *Consumer) publishThenAck(s *session, it *item, exchange, key string, headers amqp.Table, spanName string) (ok bool) {
	ctx, d := it.ctx, it.d
	msg := c.replacement(d, it.ev, headers)
	// No messaging.message.id: a delivery's message id is often its raw
	// idempotency key, which stays out of spans (the key's hash is on them).
	pctx, span := msgspan.StartPublish(ctx, c.tracer, msgspan.Publish{Name: spanName, Exchange: exchange, RoutingKey: key})
	c.prop.Inject(pctx, msgspan.Headers(msg.Headers))
	budget := s.pub.FrameMax()
	if budget > 0 && exchange != c.topo.DLX {
		// A retry copy comes back through the broker's dead-lettering,
		// which adds headers of its own.
		budget -= c.deathReserve
	}
	tooLarge := !wire.Fit(&msg, budget)
	if tooLarge {
		// Even trimmed, the copy would not fit in one frame (sending it would
		// make the broker close the connection): dead-letter it with the
		// headers it can carry.
		wire.TooLarge(&msg, s.pub.FrameMax(), ReasonHeadersTooLarge, wire.ParseAttempt(headers))
		exchange, key = c.topo.DLX, ""
		it.ev.Outcome, it.ev.Reason = OutcomeDeadLettered, ReasonHeadersTooLarge
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
			"intended", string(it.ev.Outcome), "reason", it.ev.Reason, "exchange", exchange, "routing_key", key,
			"key_hash", it.ev.KeyHash, "err", redact.Error(err))
		it.ev.Outcome, it.ev.Err = OutcomeCopyFailed, fmt.Errorf("%s to %q/%q: %w", spanName, exchange, key, err)
		if !errors.Is(err, confirm.ErrClosed) {
			select {
			case <-s.stop:
			case <-time.After(copyFailedPause):
			}
		}
		s.nack(d)
		return false
	}
	span.End()
	c.ack(s, it)
	if tooLarge {
		c.metrics.deadLetters.Add(ctx, 1, c.metrics.withLabel("reason", ReasonHeadersTooLarge))
		errText, _ := wire.String(msg.Headers[HeaderError])
		c.logDeadLetter(it, ReasonHeadersTooLarge, errText, nil)
		return false
	}
	return true
}

// ack settles the delivery once its outcome is durable: at once, or through
// the session's ack window, which coalesces acks into multiple-acks.
func (c *Consumer) ack(s *session, it *item) {
	if s.acks != nil {
		s.acks.ready(it.d.DeliveryTag)
		return
	}
	if err := it.d.Ack(false); err != nil {
		// The channel is gone: the broker redelivers, and the key makes the
		// redelivery harmless.
		c.log.Warn("ack failed; the message will be redelivered", "key_hash", it.ev.KeyHash, "err", redact.Error(err))
	}
}

// reply sends the stored response to reply_to, when the message asks for one
// (the format: docs/consumer.md, "Replies"). The first processing and every
// duplicate send the same reply. Best effort: a lost reply is recovered by
// resending the request, which gets the stored response again.
func (c *Consumer) reply(s *session, it *item, r *dedup.Result) error {
	d := it.d
	if d.ReplyTo == "" || r == nil || c.cfg.NoReply {
		return nil
	}
	msg := amqp.Publishing{
		CorrelationId: d.CorrelationId,
		MessageId:     d.MessageId,
		DeliveryMode:  amqp.Persistent,
		Body:          r.Response,
		Headers:       amqp.Table{wire.HeaderOutcome: string(r.Outcome), wire.HeaderResponseCode: int32(r.Code)},
	}
	if r.Outcome == dedup.OutcomeRejected {
		msg.Headers[wire.HeaderResponseReason] = r.Reason
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(it.ctx), c.cfg.PublishTimeout)
	defer cancel()
	if err := s.pub.PublishWait(sctx, "", d.ReplyTo, msg); err != nil {
		c.metrics.repliesFailed.Add(it.ctx, 1, c.metrics.with())
		c.log.Warn("reply not delivered; the requester gets the stored result again if it resends", "err", redact.Error(err))
		return fmt.Errorf("reply to %s: %w", d.ReplyTo, err)
	}
	return nil
}
