package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/internal/confirm"
	"github.com/idemq/idemq/internal/msgspan"
	"github.com/idemq/idemq/internal/ordering"
	"github.com/idemq/idemq/internal/outboxsql"
	"github.com/idemq/idemq/internal/redact"
)

type relayStatements struct {
	claim, lockKeys, markPublished, markFailed string
	lockClass                                  string
}

func newRelayStatements(schema string) relayStatements {
	t := pgx.Identifier{schema, "outbox"}.Sanitize()
	return relayStatements{
		// Up to $1 pending rows in id order are locked, and of those the
		// prefix whose bodies add up to at most $2 bytes is read (the first
		// row always, whatever its size); the rows past it stay locked,
		// unread, until the batch ends. A row with an ordering key is
		// eligible only while no older row of its key is pending (published
		// or parked ones do not block), so one relay holds at most the head
		// of a key. Each row carries how many were locked. The counters
		// (attempts, returns) come from the locking scan, which sees the row
		// as locked: the outer join reads the statement's snapshot, which may
		// predate another relay's commit of the same row.
		claim: `WITH locked AS MATERIALIZED (
    SELECT o.id, octet_length(o.body) AS size, o.attempts, o.returns
    FROM ` + t + ` o
    WHERE o.published_at IS NULL AND o.parked_at IS NULL AND o.available_at <= now()
      AND (o.ordering_key IS NULL OR NOT EXISTS (
          SELECT 1 FROM ` + t + ` p
          WHERE p.ordering_key = o.ordering_key AND p.id < o.id
            AND p.published_at IS NULL AND p.parked_at IS NULL))
    ORDER BY o.id
    LIMIT $1
    FOR UPDATE OF o SKIP LOCKED
), cut AS (
    SELECT id, attempts, returns, count(*) OVER () AS locked, row_number() OVER w AS n, sum(size) OVER w AS upto
    FROM locked
    WINDOW w AS (ORDER BY id)
)
SELECT o.id, o.exchange, o.routing_key, o.headers_amqp, o.headers_jsonb, o.body, o.content_type,
    o.content_encoding, o.delivery_mode, o.priority, o.correlation_id, o.reply_to,
    o.expiration, o.type, o.app_id, o.message_id, coalesce(o.ordering_key, ''), coalesce(o.sequence, 0),
    coalesce(o.traceparent, ''), coalesce(o.tracestate, ''), c.attempts, c.returns, o.created_at,
    c.locked
FROM cut c JOIN ` + t + ` o ON o.id = c.id
WHERE c.n = 1 OR c.upto <= $2
ORDER BY o.id`,

		// One transaction-scoped advisory lock per ordering key: a relay
		// whose snapshot shows an older head of the key than another relay
		// is publishing (rows commit out of id order) waits its turn.
		lockKeys: `SELECT k FROM unnest($1::text[]) AS k
WHERE pg_try_advisory_xact_lock(hashtext($2), hashtext(k))`,
		lockClass: schema + ".outbox",

		// A confirmed row moves into the record of published messages.
		markPublished: outboxsql.MarkPublished(schema),

		markFailed: `UPDATE ` + t + ` AS o
SET attempts = o.attempts + 1,
    returns = o.returns + f.returned,
    last_error = f.err,
    available_at = now() + f.delay_us * interval '1 microsecond',
    parked_at = CASE WHEN f.park THEN now() END,
    parked_reason = CASE WHEN f.park THEN f.err END
FROM unnest($1::bigint[], $2::int[], $3::text[], $4::bigint[], $5::bool[]) AS f(id, returned, err, delay_us, park)
WHERE o.id = f.id`,
	}
}

// row is one claimed outbox row.
type row struct {
	id                                      int64
	exchange, routingKey                    string
	headers, headersJSON                    []byte
	body                                    []byte
	contentType, contentEncoding            string
	deliveryMode, priority                  int16
	correlationID, replyTo, expiration, typ string
	appID, messageID, orderingKey           string
	sequence                                int64
	traceparent, tracestate                 string
	attempts, returns                       int
	createdAt                               time.Time
}

// outcome is what became of one row's publish.
type outcome int

const (
	pending   outcome = iota // not published in this batch (ordering lock held elsewhere)
	confirmed                // acked and not returned
	returned                 // unroutable, or its exchange is missing
	refused                  // the broker closed the channel over it
	nacked                   // the broker refused it
	timedOut                 // no confirm in time
	bad                      // cannot be published as stored (headers)
)

type published struct {
	row    *row
	sent   *confirm.Pending // nil when not sent
	span   trace.Span
	result outcome
	reason string
}

// relayBatch claims up to BatchSize rows (one while isolating a poison row),
// publishes them, waits for their confirms and records the results, all in
// one transaction: rows are marked only after the broker confirmed them. It
// reports whether it claimed a full batch (more may be waiting). A
// *brokerError means the session broke; the transaction then rolls back and
// the rows stay pending.
func (r *Relay) relayBatch(ctx context.Context, s *session, l *lane) (full bool, err error) {
	// The batch runs to its end even when ctx ends (that is the drain), but
	// within a bound.
	bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.ConfirmTimeout+30*time.Second)
	defer cancel()

	tx, err := r.pool.Begin(bctx)
	if err != nil {
		return false, fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(bctx)) }()

	limit := r.cfg.BatchSize
	if l.isolate > 0 {
		limit = 1
	}
	rows, claimed, cut, err := r.claim(bctx, tx, limit)
	if err != nil {
		return false, err
	}
	// Rows skipped for their ordering key's lock do not count: another
	// relay is publishing that key; wait to be woken rather than spin.
	full = (claimed == limit || cut) && len(rows) > 0
	if l.isolate > 0 {
		l.isolate = max(l.isolate-1, 0)
		if claimed == 0 {
			l.isolate = 0
		}
	}
	if len(rows) == 0 {
		return full, nil
	}
	pubs, err := r.publishAll(bctx, s, rows)
	timeout := false
	if err == nil {
		var closed bool
		timeout, closed = r.awaitConfirms(pubs)
		if closed || !s.Alive() {
			// Pending confirms of a closed channel read as nacks: trust none.
			err = &brokerError{fmt.Errorf("channel closed during the batch: %w", s.deathErr())}
		}
	}
	if err != nil {
		endSpans(pubs, err)
		// The batch's rows stay locked while suspect looks: another lane
		// cannot take a poison row before its failure is recorded.
		r.suspect(bctx, s, l, tx, pubs)
		return false, err
	}
	if r.afterConfirm != nil && r.afterConfirm(bctx) {
		// Dies as a process does (see internal/relaykit): the broker has
		// the messages, the rows stay pending.
		_ = tx.Conn().Close(context.WithoutCancel(bctx))
		err := &brokerError{errors.New("the relay crashed after the confirms, before marking the rows")}
		endSpans(pubs, err)
		return false, err
	}
	if err := r.record(bctx, tx, pubs); err != nil {
		endSpans(pubs, err)
		return false, err
	}
	if err := tx.Commit(bctx); err != nil {
		// The broker has the messages; the rows stay pending and will be
		// published again, with the same message ids.
		err = fmt.Errorf("commit: %w", err)
		endSpans(pubs, err)
		return false, err
	}
	r.report(bctx, pubs)
	for _, w := range rows {
		if w.orderingKey != "" {
			// Its key's next row is eligible now: look again at once
			// rather than wait for a wake-up.
			full = true
			break
		}
	}
	if timeout {
		// Late confirms and returns may still come on this channel: start
		// a fresh one rather than mistake them for the next batch's.
		return full, &brokerError{errors.New("publisher confirms timed out")}
	}
	return full, nil
}

// suspect looks at a session that died during a batch. When the broker
// closed it for a reason of its own (not CONNECTION_FORCED: an operator or a
// shutdown), a row of the batch may be the cause, a property the broker
// refuses. A batch of several rows makes the relay publish the next ones one
// at a time; a batch of one row is that row's fault, recorded like a return.
func (r *Relay) suspect(ctx context.Context, s *session, l *lane, tx pgx.Tx, pubs []*published) {
	select {
	case <-s.Dead():
	case <-time.After(time.Second):
		return
	}
	var ae *amqp.Error
	if !errors.As(s.deathErr(), &ae) || !ae.Server || ae.Code == amqp.ConnectionForced {
		return
	}
	if len(pubs) > 1 {
		l.isolate = len(pubs)
		r.log.Warn("outbox relay: the broker closed the channel during a batch; publishing one row at a time to find the cause",
			"rows", len(pubs), "code", ae.Code, "reason", ae.Reason)
		return
	}
	if len(pubs) == 0 || pubs[0].sent == nil {
		return
	}
	p := pubs[0]
	p.result = refused
	p.reason = fmt.Sprintf("the broker closed the channel: %d %s", ae.Code, ae.Reason)
	err := r.record(ctx, tx, pubs)
	if err == nil {
		err = tx.Commit(ctx)
	}
	if err != nil {
		r.log.Warn("outbox relay cannot record a failed row", "id", p.row.id, "error", err)
		return
	}
	p.span = nil // ended already
	r.report(ctx, pubs)
}

// claim locks up to limit rows and returns those it may publish (within
// MaxBatchBytes), how many it locked, and whether the byte bound cut the
// batch short.
func (r *Relay) claim(ctx context.Context, tx pgx.Tx, limit int) (rows []*row, claimed int, cut bool, err error) {
	rs, err := tx.Query(ctx, r.sql.claim, limit, r.cfg.MaxBatchBytes)
	if err != nil {
		return nil, 0, false, fmt.Errorf("claim: %w", err)
	}
	rows, err = pgx.CollectRows(rs, func(rs pgx.CollectableRow) (*row, error) {
		var w row
		err := rs.Scan(&w.id, &w.exchange, &w.routingKey, &w.headers, &w.headersJSON, &w.body, &w.contentType,
			&w.contentEncoding, &w.deliveryMode, &w.priority, &w.correlationID, &w.replyTo,
			&w.expiration, &w.typ, &w.appID, &w.messageID, &w.orderingKey, &w.sequence,
			&w.traceparent, &w.tracestate, &w.attempts, &w.returns, &w.createdAt,
			&claimed)
		return &w, err
	})
	if err != nil {
		return nil, 0, false, fmt.Errorf("claim: %w", err)
	}
	cut = claimed > len(rows)
	var keys []string
	for _, w := range rows {
		if w.orderingKey != "" {
			keys = append(keys, w.orderingKey)
		}
	}
	if len(keys) == 0 {
		return rows, claimed, cut, nil
	}
	krs, err := tx.Query(ctx, r.sql.lockKeys, keys, r.sql.lockClass)
	if err != nil {
		return nil, 0, false, fmt.Errorf("lock ordering keys: %w", err)
	}
	locked, err := pgx.CollectRows(krs, pgx.RowTo[string])
	if err != nil {
		return nil, 0, false, fmt.Errorf("lock ordering keys: %w", err)
	}
	held := make(map[string]bool, len(locked))
	for _, k := range locked {
		held[k] = true
	}
	out := rows[:0]
	for _, w := range rows {
		if w.orderingKey == "" || held[w.orderingKey] {
			out = append(out, w)
		}
	}
	return out, claimed, cut, nil
}

// publishAll publishes the rows in id order, mandatory and with confirms,
// and sends them to the broker together (session.hold).
func (r *Relay) publishAll(ctx context.Context, s *session, rows []*row) (pubs []*published, err error) {
	s.hold()
	defer func() {
		if rerr := s.release(); err == nil {
			err = rerr
		}
	}()
	pubs = make([]*published, 0, len(rows))
	for _, w := range rows {
		p := &published{row: w}
		pubs = append(pubs, p)
		ok, err := s.exchangeExists(w.exchange)
		if err != nil {
			return pubs, err
		}
		if !ok {
			p.result, p.reason = returned, "exchange not found"
			continue
		}
		headers, err := decodeHeaders(w.headers, w.headersJSON)
		if err != nil {
			p.result, p.reason = bad, err.Error()
			continue
		}
		if headers == nil {
			headers = amqp.Table{}
		}
		if w.orderingKey != "" {
			// The next consumer checks the key's order (docs/ordering.md).
			if _, set := headers[ordering.HeaderKey]; !set {
				headers[ordering.HeaderKey] = w.orderingKey
			}
			if w.sequence > 0 {
				headers[ordering.HeaderSequence] = w.sequence
			}
		}
		spanCtx, span := r.startSpan(ctx, w, headers)
		p.span = span
		r.prop.Inject(spanCtx, msgspan.Headers(headers))
		sent, err := s.Publisher().Publish(ctx, w.exchange, w.routingKey, amqp.Publishing{
			Headers:         headers,
			ContentType:     w.contentType,
			ContentEncoding: w.contentEncoding,
			DeliveryMode:    uint8(w.deliveryMode),
			Priority:        uint8(w.priority),
			CorrelationId:   w.correlationID,
			ReplyTo:         w.replyTo,
			Expiration:      w.expiration,
			MessageId:       w.messageID,
			Timestamp:       w.createdAt,
			Type:            w.typ,
			AppId:           w.appID,
			Body:            w.body,
		})
		if errors.Is(err, confirm.ErrTooLarge) {
			// Never sent: the broker would close the connection over it.
			p.result, p.reason = bad, err.Error()
			continue
		}
		if err != nil {
			return pubs, &brokerError{fmt.Errorf("publish: %w", err)}
		}
		p.sent = sent
	}
	return pubs, nil
}

func (r *Relay) startSpan(ctx context.Context, w *row, headers amqp.Table) (context.Context, trace.Span) {
	// The row's W3C columns first, then the relay's propagator over the
	// row's headers, where Enqueue put the rest of its carrier (B3, Jaeger,
	// baggage): a context found there wins.
	parent := propagation.TraceContext{}.Extract(ctx, propagation.MapCarrier{
		"traceparent": w.traceparent, "tracestate": w.tracestate,
	})
	parent = r.prop.Extract(parent, msgspan.Headers(headers))
	ctx, span := msgspan.StartPublish(parent, r.tracer, msgspan.Publish{
		Exchange: w.exchange, RoutingKey: w.routingKey, MessageID: w.messageID,
	})
	if span.IsRecording() {
		span.SetAttributes(attribute.Int64("idemq.outbox.id", w.id), attribute.Int("idemq.outbox.attempt", w.attempts+1))
	}
	return ctx, span
}

// awaitConfirms waits for the result of every publish of the batch (its
// confirm, and its return if any: see internal/confirm) until the confirm
// timeout. It reports whether the timeout struck, and whether the channel
// closed before a result came.
func (r *Relay) awaitConfirms(pubs []*published) (timeout, closed bool) {
	deadline := time.NewTimer(r.cfg.ConfirmTimeout)
	defer deadline.Stop()
wait:
	for _, p := range pubs {
		if p.sent == nil {
			continue
		}
		select {
		case <-p.sent.Done():
		case <-deadline.C:
			timeout = true
			break wait
		}
	}
	for _, p := range pubs {
		if p.sent == nil {
			continue
		}
		select {
		case <-p.sent.Done():
		default:
			p.result, p.reason = timedOut, "publisher confirm timed out"
			continue
		}
		err := p.sent.Err()
		switch {
		case err == nil:
			p.result = confirmed
		case errors.Is(err, confirm.ErrUnroutable):
			p.result, p.reason = returned, err.Error()
		case errors.Is(err, confirm.ErrNacked):
			p.result, p.reason = nacked, err.Error()
		default: // the channel closed first: fate unknown
			p.result, p.reason, closed = timedOut, err.Error(), true
		}
	}
	return timeout, closed
}

// record writes the batch's results into the claimed rows.
func (r *Relay) record(ctx context.Context, tx pgx.Tx, pubs []*published) error {
	var ok []int64
	var ids, delays []int64
	var rets []int32
	var errs []string
	var parks []bool
	for _, p := range pubs {
		w := p.row
		switch p.result {
		case pending:
			continue
		case confirmed:
			ok = append(ok, w.id)
			continue
		}
		ret := int32(0)
		park := false
		switch p.result {
		case returned, refused:
			ret = 1
			park = w.returns+1 >= r.cfg.MaxReturns
		case bad:
			park = true
		}
		ids = append(ids, w.id)
		rets = append(rets, ret)
		errs = append(errs, p.reason)
		delays = append(delays, r.retryDelay(w.attempts+1).Microseconds())
		parks = append(parks, park)
		p.reason = fmt.Sprintf("%s (attempt %d)", p.reason, w.attempts+1)
		if park {
			p.result = parkedOutcome(p.result)
		}
	}
	if len(ok) > 0 {
		if _, err := tx.Exec(ctx, r.sql.markPublished, ok); err != nil {
			return fmt.Errorf("mark published: %w", err)
		}
	}
	if len(ids) > 0 {
		if _, err := tx.Exec(ctx, r.sql.markFailed, ids, rets, errs, delays, parks); err != nil {
			return fmt.Errorf("mark failed: %w", err)
		}
	}
	return nil
}

// parked outcomes are the failed ones plus a flag; kept apart for reporting.
const parkedFlag outcome = 1 << 8

func parkedOutcome(o outcome) outcome { return o | parkedFlag }

// retryDelay is the ExponentialBackOff delay before the given attempt's
// successor: RetryInitial × 1.5^(attempt-1), capped at RetryMax, ±50% jitter.
func (r *Relay) retryDelay(attempt int) time.Duration {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval = r.cfg.RetryInitial
	bo.MaxInterval = r.cfg.RetryMax
	bo.MaxElapsedTime = 0
	bo.Reset()
	d := bo.InitialInterval
	for range min(attempt, 64) {
		d = bo.NextBackOff()
	}
	return d
}

// report counts, logs and ends the spans of a committed batch.
func (r *Relay) report(ctx context.Context, pubs []*published) {
	for _, p := range pubs {
		w := p.row
		parked := p.result&parkedFlag != 0
		result := p.result &^ parkedFlag
		switch result {
		case pending:
			endSpan(p.span, nil)
			continue
		case confirmed:
			r.counts.published.Add(1)
			r.inst.published.Add(ctx, 1, r.inst.attrs)
			r.inst.lag.Record(ctx, time.Since(w.createdAt).Seconds(), r.inst.attrs)
			endSpan(p.span, nil)
			continue
		case returned:
			r.counts.returned.Add(1)
			r.inst.returned.Add(ctx, 1, r.inst.attrs)
			r.log.Warn("outbox message unroutable: kept, will be retried or parked",
				"id", w.id, "message_id", w.messageID, "exchange", w.exchange, "routing_key", w.routingKey,
				"returns", w.returns+1, "max_returns", r.cfg.MaxReturns, "reason", p.reason, "parked", parked)
		case refused:
			r.counts.returned.Add(1)
			r.inst.returned.Add(ctx, 1, r.inst.attrs)
			r.log.Warn("outbox message refused by the broker: kept, will be retried or parked",
				"id", w.id, "message_id", w.messageID, "exchange", w.exchange, "routing_key", w.routingKey,
				"returns", w.returns+1, "max_returns", r.cfg.MaxReturns, "reason", p.reason, "parked", parked)
		case nacked:
			r.counts.nacked.Add(1)
			r.inst.nacked.Add(ctx, 1, r.inst.attrs)
			r.log.Warn("outbox message nacked by the broker: kept, will be retried",
				"id", w.id, "message_id", w.messageID, "exchange", w.exchange, "attempt", w.attempts+1)
		case timedOut:
			r.counts.timedOut.Add(1)
			r.inst.timedOut.Add(ctx, 1, r.inst.attrs)
			r.log.Warn("outbox message not confirmed in time: kept, will be retried",
				"id", w.id, "message_id", w.messageID, "exchange", w.exchange, "attempt", w.attempts+1)
		case bad:
			r.log.Error("outbox row cannot be published as stored",
				"id", w.id, "message_id", w.messageID, "reason", p.reason)
		}
		if parked {
			r.counts.parked.Add(1)
			r.inst.parked.Add(ctx, 1, r.inst.attrs)
			args := []any{"id", w.id, "message_id", w.messageID, "exchange", w.exchange, "routing_key", w.routingKey, "reason", p.reason}
			if w.orderingKey != "" {
				args = append(args, "ordering", "later messages of its ordering key are published without it")
			}
			r.log.Warn("outbox message PARKED: it will not be published until an operator acts", args...)
		}
		endSpan(p.span, errors.New(p.reason))
	}
}

func endSpans(pubs []*published, err error) {
	for _, p := range pubs {
		endSpan(p.span, err)
	}
}

func endSpan(span trace.Span, err error) {
	if span == nil {
		return
	}
	if err != nil {
		span.SetStatus(codes.Error, redact.Error(err))
	}
	span.End()
}
