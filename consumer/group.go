package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/redact"
)

// BatchHandler handles a batch of deliveries in one transaction: whatever
// it writes in tx commits together with the completion of every key of the
// batch, with one commit. It returns one Response per delivery, in order.
//
// If it returns an error, the batch's transaction rolls back and each
// delivery is handled again alone (a batch of one, under its own savepoint),
// so that one bad message never fails its batch-mates: its own error then
// decides its outcome exactly as for a Handler (Reject, Permanent, retry).
type BatchHandler func(ctx context.Context, tx pgx.Tx, ds []*Delivery) ([]Response, error)

// collect takes the deliveries of one group: first, then whatever is
// already waiting (and, with GroupLinger, whatever arrives within it), up to
// GroupSize.
func (c *Consumer) collect(first *amqp.Delivery, deliveries <-chan amqp.Delivery, stop <-chan struct{}) []*amqp.Delivery {
	group := []*amqp.Delivery{first}
	var linger <-chan time.Time
	if c.cfg.GroupLinger > 0 {
		t := time.NewTimer(c.cfg.GroupLinger)
		defer t.Stop()
		linger = t.C
	}
	for len(group) < c.cfg.GroupSize {
		if linger == nil {
			select {
			case d, ok := <-deliveries:
				if !ok {
					return group
				}
				group = append(group, &d)
				continue
			default:
				return group
			}
		}
		select {
		case d, ok := <-deliveries:
			if !ok {
				return group
			}
			group = append(group, &d)
		case <-linger:
			return group
		case <-stop:
			return group
		}
	}
	return group
}

// processGroup takes a group of deliveries to their outcomes with one
// reserve statement and one commit: each handler runs under its own
// savepoint of a shared transaction (or a BatchHandler runs once), so a
// failing handler rolls back only its own effects and key.
func (c *Consumer) processGroup(ctx context.Context, s *session, ds []*amqp.Delivery) {
	items := make([]*item, 0, len(ds))
	for _, d := range ds {
		items = append(items, c.begin(ctx, d))
	}
	defer func() {
		s.flush()
		for _, it := range items {
			c.finish(it)
		}
	}()

	// Claim what can be claimed; repeats of a key within the group wait for
	// the group to end and then take the single path (they find a duplicate).
	var claimed, repeats []*item
	seen := map[[2]string]bool{}
	for _, it := range items {
		if !c.prepare(s, it) {
			continue
		}
		k := [2]string{it.claim.Tenant, it.claim.Key}
		if seen[k] {
			repeats = append(repeats, it)
			continue
		}
		seen[k] = true
		claimed = append(claimed, it)
	}
	if len(claimed) > 0 {
		c.reserveAndRun(ctx, s, claimed)
	}
	items = removeAll(items, repeats)
	for _, it := range repeats {
		it.span.End() // the single path starts a span of its own
		c.process(ctx, s, it.d)
	}
}

func (c *Consumer) reserveAndRun(ctx context.Context, s *session, claimed []*item) {
	claims := make([]dedup.Claim, len(claimed))
	for i, it := range claimed {
		claims[i] = it.claim
	}
	rctx, cancel := c.storeCtx(ctx)
	defer cancel()
	rctx, rspan := c.tracer.Start(rctx, "idemq reserve batch", groupLinks(claimed))
	rspan.SetAttributes(attribute.Int("idemq.batch.size", len(claims)))
	t0 := time.Now()
	res, err := c.store.ReserveBatch(rctx, claims)
	c.metrics.reserveTime.Record(ctx, time.Since(t0).Seconds(), c.metrics.with())
	rspan.End()
	if err != nil {
		for _, it := range claimed {
			it.ev = c.retryOrDeadLetter(it.ctx, s, it.d, it.ev, it.attempt, fmt.Errorf("reserve: %w", err))
		}
		return
	}
	var acquired []*item
	for i, it := range claimed {
		it.span.AddEvent("idemq reserve", trace.WithAttributes(attribute.String("idemq.decision", res[i].Decision.String())))
		if c.decide(s, it, res[i]) {
			acquired = append(acquired, it)
		}
	}
	if len(acquired) > 0 {
		// Run (and so lock the key rows) in the global key order that batch
		// reservations use, so that the two never wait on each other in a cycle.
		slices.SortFunc(acquired, func(a, b *item) int {
			return cmp.Or(cmp.Compare(a.claim.Tenant, b.claim.Tenant), cmp.Compare(a.claim.Key, b.claim.Key))
		})
		c.runGroup(ctx, s, acquired)
	}
}

// groupResult is one acquired item's fate inside the shared transaction.
type groupResult struct {
	result    dedup.Result
	err       error
	bystander bool
}

// runGroup runs the acquired items' handlers in one transaction and settles them.
func (c *Consumer) runGroup(ctx context.Context, s *session, items []*item) {
	c.inFlight.Add(int64(len(items)))
	c.metrics.inProgress.Add(ctx, int64(len(items)), c.metrics.with())
	defer func() {
		c.inFlight.Add(-int64(len(items)))
		c.metrics.inProgress.Add(context.WithoutCancel(ctx), -int64(len(items)), c.metrics.with())
	}()
	leases := make([]*dedup.Lease, len(items))
	for i, it := range items {
		leases[i] = it.lease
	}
	if !c.cfg.DisableHeartbeat {
		stop := c.groupHeartbeat(ctx, leases)
		defer stop()
	}
	t0 := time.Now()
	results := c.runGroupTx(ctx, items)
	c.metrics.handlerTime.Record(ctx, time.Since(t0).Seconds(), c.metrics.with())
	c.releaseFailed(ctx, items, results)
	for i, it := range items {
		r := results[i]
		if r.err == nil {
			if r.result.Outcome == dedup.OutcomeRejected {
				it.ev.Outcome = OutcomeRejected
			} else {
				it.ev.Outcome = OutcomeProcessed
			}
			it.ev.ReplyErr = c.reply(it.ctx, s, it.d, &r.result)
			it.ev = c.ack(s, it.d, it.ev)
			continue
		}
		it.ev = c.settleFailure(it.ctx, s, it.d, it.ev, it.attempt, nil, r.err, r.bystander)
	}
}

// releaseFailed releases, with one statement bounded by StoreTimeout, the
// keys of the items whose run did not commit (a lost lease has nothing to
// release), so that their retries take them over at once.
func (c *Consumer) releaseFailed(ctx context.Context, items []*item, results []groupResult) {
	var leases []*dedup.Lease
	for i, it := range items {
		if err := results[i].err; err != nil && !errors.Is(err, dedup.ErrLeaseLost) {
			leases = append(leases, it.lease)
		}
	}
	if len(leases) == 0 {
		return
	}
	sctx, cancel := c.storeCtx(context.WithoutCancel(ctx))
	defer cancel()
	if _, err := c.store.ReleaseBatch(sctx, leases); err != nil {
		c.log.Warn("release keys failed; the leases will expire", "keys", len(leases), "err", redact.Error(err))
	}
}

// runGroupTx runs the handlers and commits. Every item's result says
// whether its effects committed (err == nil).
func (c *Consumer) runGroupTx(ctx context.Context, items []*item) []groupResult {
	if c.batchHandler != nil || c.cfg.GroupOptimistic {
		if out, ok := c.runWhole(ctx, items); ok {
			return out
		}
	}
	return c.runIsolated(ctx, items)
}

// failAll marks every item not yet failed as failed with err.
func failAll(out []groupResult, err error) []groupResult {
	for i := range out {
		if out[i].err == nil {
			out[i] = groupResult{err: err}
		}
	}
	return out
}

// runWhole runs the whole group in one transaction without savepoints: the
// batch handler once, or (optimistic) each handler straight in the
// transaction; then all keys are completed with one statement and committed
// once. It reports false, with nothing committed, when a handler failed or a
// lease was lost: the caller then runs the items isolated. A failed commit
// fails the group instead: its outcome is unknown, so nothing runs again.
func (c *Consumer) runWhole(ctx context.Context, items []*item) ([]groupResult, bool) {
	tx, err := c.beginGroup(ctx)
	if err != nil {
		return nil, false
	}
	defer c.rollback(ctx, tx)
	var results []dedup.Result
	if c.batchHandler != nil {
		results, err = c.runBatch(ctx, tx, items)
	} else {
		results, err = c.runHandlers(ctx, tx, items)
	}
	if err != nil {
		return nil, false
	}
	leases := make([]*dedup.Lease, len(items))
	for i, it := range items {
		leases[i] = it.lease
	}
	cctx, cspan := c.tracer.Start(ctx, "idemq complete", groupLinks(items))
	defer cspan.End()
	lost, err := c.completeBatch(cctx, tx, leases, results)
	if err != nil || len(lost) > 0 {
		cspan.AddEvent("idemq.group_isolated", trace.WithAttributes(attribute.Int("idemq.leases_lost", len(lost))))
		return nil, false
	}
	out := make([]groupResult, len(items))
	if err := c.commit(cctx, tx); err != nil {
		cspan.SetStatus(codes.Error, redact.Error(err))
		return failAll(out, fmt.Errorf("commit: %w", err)), true
	}
	for i := range out {
		out[i] = groupResult{result: results[i]}
	}
	return out, true
}

// runBatch runs the batch handler over all items in tx.
func (c *Consumer) runBatch(ctx context.Context, tx pgx.Tx, items []*item) ([]dedup.Result, error) {
	hctx, cancel := context.WithTimeoutCause(ctx, c.cfg.HandlerTimeout, errHandlerTimeout)
	defer cancel()
	hctx, hspan := c.tracer.Start(hctx, "idemq batch handler", groupLinks(items))
	defer hspan.End()
	hspan.SetAttributes(attribute.Int("idemq.batch.size", len(items)))
	dels := make([]*Delivery, len(items))
	for i, it := range items {
		dels[i] = it.del
	}
	resps, err := c.safeBatchCall(hctx, handlerTx{tx}, dels)
	if err == nil && len(resps) != len(items) {
		err = fmt.Errorf("batch handler returned %d responses for %d deliveries", len(resps), len(items))
	}
	if err != nil {
		hspan.SetStatus(codes.Error, redact.Error(err))
		hspan.AddEvent("idemq.batch_isolated")
		return nil, err
	}
	results := make([]dedup.Result, len(items))
	for i, r := range resps {
		results[i] = dedup.Result{Outcome: dedup.OutcomeOK, Code: r.Code, Response: r.Body}
	}
	return results, nil
}

// runHandlers runs every handler of the group straight in tx, without a
// savepoint each: one statement per message beyond the handler's own. The
// first failure stops the pass (the caller rolls it back and isolates).
func (c *Consumer) runHandlers(ctx context.Context, tx pgx.Tx, items []*item) ([]dedup.Result, error) {
	results := make([]dedup.Result, len(items))
	for i, it := range items {
		hctx, cancel := context.WithTimeoutCause(it.ctx, c.cfg.HandlerTimeout, errHandlerTimeout)
		hctx, hspan := c.tracer.Start(hctx, "idemq handler")
		var herr error
		results[i], herr = storedResult(c.safeCall(c.withClaim(hctx, it.del), handlerTx{tx}, it.del))
		if herr != nil {
			hspan.AddEvent("idemq.group_isolated")
		}
		hspan.End()
		cancel()
		if herr != nil {
			return nil, herr
		}
	}
	return results, nil
}

// runIsolated runs each handler under a savepoint of one shared transaction
// and completes its key there, so that a failing handler rolls back only its
// own effects and key; then it commits once.
func (c *Consumer) runIsolated(ctx context.Context, items []*item) []groupResult {
	out := make([]groupResult, len(items))
	tx, err := c.beginGroup(ctx)
	if err != nil {
		return failAll(out, err)
	}
	defer c.rollback(ctx, tx)
	sp := &savepoints{tx: tx}
	sctx, cancel := c.storeCtx(ctx)
	err = sp.open(sctx)
	cancel()
	if err != nil {
		return failAll(out, fmt.Errorf("savepoint: %w", err))
	}
	for i, it := range items {
		if err := c.runOne(ctx, sp, it, &out[i], i < len(items)-1); err != nil {
			// The shared transaction is broken: what ran before is lost
			// too, through no fault of its own.
			for j := range items {
				if j != i && (j > i || out[j].err == nil) {
					out[j] = groupResult{err: fmt.Errorf("batch-mate broke the transaction: %w", err), bystander: true}
				}
			}
			out[i] = groupResult{err: err}
			return out
		}
	}
	cctx, cspan := c.tracer.Start(ctx, "idemq commit group", groupLinks(items))
	defer cspan.End()
	if err := c.commit(cctx, tx); err != nil {
		cspan.SetStatus(codes.Error, redact.Error(err))
		return failAll(out, fmt.Errorf("commit: %w", err))
	}
	return out
}

// beginGroup opens a group's transaction, bounded by StoreTimeout.
func (c *Consumer) beginGroup(ctx context.Context) (pgx.Tx, error) {
	bctx, cancel := c.storeCtx(ctx)
	defer cancel()
	tx, err := c.store.Pool().Begin(bctx)
	if err != nil {
		return nil, fmt.Errorf("begin group: %w", err)
	}
	return tx, nil
}

// completeBatch completes a whole group's keys, bounded by StoreTimeout.
func (c *Consumer) completeBatch(ctx context.Context, tx pgx.Tx, leases []*dedup.Lease, results []dedup.Result) ([]*dedup.Lease, error) {
	cctx, cancel := c.storeCtx(ctx)
	defer cancel()
	return c.store.CompleteBatch(cctx, tx, leases, results)
}

// commit commits a group's transaction, bounded by StoreTimeout. A commit
// that times out has an unknown fate: the group is retried, and each retry
// finds its key completed (a duplicate) if the commit did land.
func (c *Consumer) commit(ctx context.Context, tx pgx.Tx) error {
	cctx, cancel := c.storeCtx(ctx)
	defer cancel()
	return tx.Commit(cctx)
}

// runOne runs one item's handler above the newest savepoint and completes
// its key; with more items to come, the next savepoint is opened in the same
// round trip as the completion. The item's own failure (its handler's error,
// a lost lease) rolls back to the savepoint and is recorded in r; a returned
// error means the shared transaction itself is broken.
func (c *Consumer) runOne(ctx context.Context, sp *savepoints, it *item, r *groupResult, more bool) error {
	hctx, cancel := context.WithTimeoutCause(it.ctx, c.cfg.HandlerTimeout, errHandlerTimeout)
	defer cancel()
	hctx, hspan := c.tracer.Start(hctx, "idemq handler")
	defer hspan.End()
	// In batch mode c.handler runs the batch handler over this one delivery.
	result, herr := storedResult(c.safeCall(c.withClaim(hctx, it.del), handlerTx{sp.tx}, it.del))
	if herr == nil {
		herr = sp.completeAndOpen(hctx, c.store, it.lease, result, more)
	}
	if herr != nil {
		hspan.SetStatus(codes.Error, redact.Error(herr))
		r.err = herr
		rctx, rcancel := c.storeCtx(context.WithoutCancel(ctx))
		defer rcancel()
		if err := sp.rollback(rctx); err != nil {
			return fmt.Errorf("roll back to savepoint: %w", err)
		}
		return nil
	}
	r.result = result
	return nil
}

// maxSavepointGroup is the largest savepoint group that stays within the
// subtransactions a Postgres backend caches (PGPROC_MAX_CACHED_SUBXIDS):
// beyond it, every session's snapshots must look subtransactions up on disk
// while the group runs.
const maxSavepointGroup = 64

// savepoints is the stack of savepoints of an isolated group: each item runs
// above the newest one, which its failure rolls back to (and which then
// serves the next item); its success opens the next.
type savepoints struct {
	tx pgx.Tx
	n  int
}

func (sp *savepoints) name(n int) string { return "idemq_item_" + strconv.Itoa(n) }

func (sp *savepoints) open(ctx context.Context) error {
	if _, err := sp.tx.Exec(ctx, "SAVEPOINT "+sp.name(sp.n+1)); err != nil {
		return err
	}
	sp.n++
	return nil
}

func (sp *savepoints) rollback(ctx context.Context) error {
	_, err := sp.tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+sp.name(sp.n))
	return err
}

// completeAndOpen completes the key and, when open, opens the next
// savepoint: one round trip. A failure of either leaves the newest
// savepoint where it was (a lease lost after the next one was opened is
// undone by the rollback to the older one).
func (sp *savepoints) completeAndOpen(ctx context.Context, store *dedup.Store, l *dedup.Lease, r dedup.Result, open bool) error {
	b := &pgx.Batch{}
	if err := store.QueueComplete(b, l, r); err != nil {
		return err
	}
	if open {
		b.Queue("SAVEPOINT " + sp.name(sp.n+1))
	}
	if err := sp.tx.SendBatch(ctx, b).Close(); err != nil {
		return err
	}
	if open {
		sp.n++
	}
	return nil
}

// groupLinks links a span of a whole group, which belongs to no single
// delivery's trace, to the process span of each delivery of the group.
func groupLinks(items []*item) trace.SpanStartOption {
	links := make([]trace.Link, 0, len(items))
	for _, it := range items {
		links = append(links, trace.LinkFromContext(it.ctx))
	}
	return trace.WithLinks(links...)
}

// handlerTx is the shared transaction as a handler of a group sees it: the
// runtime commits it, once, for the whole group.
type handlerTx struct{ pgx.Tx }

var errGroupTx = errors.New("the handler's transaction belongs to the runtime: it commits or rolls back for the whole group")

func (handlerTx) Commit(context.Context) error   { return errGroupTx }
func (handlerTx) Rollback(context.Context) error { return errGroupTx }

func (c *Consumer) safeBatchCall(ctx context.Context, tx pgx.Tx, ds []*Delivery) (resps []Response, err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &PanicError{Value: v}
		}
	}()
	return c.batchHandler(ctx, tx, ds)
}

// groupHeartbeat extends the group's leases with one statement every
// lease/3. A lost lease needs no cancellation here: the key's completion is
// fenced and fails under its savepoint. As for a single lease, each extend
// is bounded by the period and stop cancels the one in flight.
func (c *Consumer) groupHeartbeat(ctx context.Context, leases []*dedup.Lease) (stop func()) {
	period := beatPeriod(leases[0])
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
				bctx, cancel := context.WithTimeout(ctx, period)
				_, err := c.store.ExtendBatch(bctx, leases, c.cfg.Lease)
				cancel()
				if err != nil && ctx.Err() == nil {
					c.log.Warn("lease heartbeat failed", "err", redact.Error(err))
				}
			}
		}
	}()
	return func() { endBeats(); <-finished }
}

func removeAll(items, drop []*item) []*item {
	if len(drop) == 0 {
		return items
	}
	gone := make(map[*item]bool, len(drop))
	for _, it := range drop {
		gone[it] = true
	}
	out := items[:0]
	for _, it := range items {
		if !gone[it] {
			out = append(out, it)
		}
	}
	return out
}
