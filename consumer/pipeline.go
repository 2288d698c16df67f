package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer/internal/kit"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/outbox"
)

// Every delivery goes through one pipeline, whatever the mode:
//
//	collect  one accumulator per session forms groups of up to Group.Size
//	         deliveries (Group.Linger waits for a group to fill) and hands each
//	         to the first of Concurrency executors that is free; a group of
//	         one is the per-message mode.
//	claim    each delivery's key, tenant and fingerprint are read (prepare),
//	         the group's keys are reserved with one statement by the key
//	         holder (keys.go: in the group's transaction, or as leases), and
//	         what is not acquired (duplicate, busy, key reuse) is settled at
//	         once (claim).
//	execute  the acquired items run under the consumer's runner (runner.go:
//	         isolated, whole, batch) in one transaction.
//	commit   the keys not completed yet are completed with one statement,
//	         the failed ones given up (held) and the transaction committed
//	         once (commit); a whole group that failed is rolled back and
//	         re-queued to run isolated (requeue).
//	settle   each item gets its outcome: acked after the commit, or replaced by
//	         a retry or dead-letter copy the broker confirmed (settle.go).
//
// The key holder and the runner are chosen by New; Consumer.execute is the
// one path, and the executor's queue of units (processItems) its one loop.

// collect forms groups from in and hands them to out until in closes or
// stop is closed; then it closes out. A group goes when it is full, or when
// an executor is free, the group's linger is over (or there is none) and
// fewer than c.partialLimit groups are executing (none: no limit). While
// every executor is busy, or while a batch handler's group executes, the
// group keeps filling, so groups grow with the load. Deliveries of a group
// not yet handed over when it stops are never acked: the broker
// redelivers them.
func (c *Consumer) collect(stop <-chan struct{}, in <-chan amqp.Delivery, out chan<- []*amqp.Delivery, ex *executing) {
	defer close(out)
	size := c.cfg.Group.Size
	var (
		group  []*amqp.Delivery
		timer  *time.Timer
		linger <-chan time.Time
		ready  bool // the group may go before it is full
	)
	add := func(d amqp.Delivery) {
		group = append(group, &d)
		if len(group) > 1 {
			return
		}
		if c.cfg.Group.Linger <= 0 || size == 1 {
			ready = true
			return
		}
		timer = time.NewTimer(c.cfg.Group.Linger)
		linger = timer.C
	}
	for {
		// Take whatever is already waiting first: a free executor gets the
		// fullest group there is.
	fill:
		for len(group) < size {
			select {
			case d, ok := <-in:
				if !ok {
					return
				}
				add(d)
			default:
				break fill
			}
		}
		var send chan<- []*amqp.Delivery
		if len(group) >= size || (len(group) > 0 && ready && ex.below(c.partialLimit)) {
			send = out
		}
		receive := in
		if len(group) >= size {
			receive = nil
		}
		select {
		case d, ok := <-receive:
			if !ok {
				return
			}
			add(d)
		case send <- group:
			ex.started()
			group, ready, linger = nil, false, nil
			if timer != nil {
				timer.Stop()
			}
		case <-linger:
			ready, linger = true, nil
		case <-ex.freed:
			// a group finished: a waiting group may go now
		case <-stop:
			return
		}
	}
}

// batchPartialLimit is how many of a BatchHandler's groups may execute
// while a group that is not full goes to a free executor: a batch costs
// about as much for one delivery as for a hundred, so under load the next
// group fills while one executes (group commit), and a full group still
// goes to any free executor. With nothing executing a group goes at once,
// adding no latency when the load is light.
const batchPartialLimit = 2

// executing counts the groups a session's executors run, for the
// collector, and tells it when one finishes.
type executing struct {
	n     atomic.Int32
	freed chan struct{} // a group finished; buffered, never blocks
}

func newExecuting() *executing { return &executing{freed: make(chan struct{}, 1)} }

// started counts a group handed to an executor (by the collector, so that
// its next look already counts it).
func (e *executing) started() { e.n.Add(1) }

// finished counts a group done and wakes the collector.
func (e *executing) finished() {
	e.n.Add(-1)
	select {
	case e.freed <- struct{}{}:
	default:
	}
}

// below reports whether fewer than limit groups execute; a limit of 0 is
// no limit.
func (e *executing) below(limit int) bool { return limit <= 0 || int(e.n.Load()) < limit }

// execute runs groups from in until it closes, then returns.
func (c *Consumer) executeGroups(ctx context.Context, s *session, in <-chan []*amqp.Delivery, ex *executing) {
	for group := range in {
		c.processGroup(ctx, s, group)
		s.budget.give(bodyBytes(group))
		ex.finished()
	}
}

// runPipeline starts the collector and the executors of one session; the
// returned channel is closed once every executor has returned.
func (c *Consumer) runPipeline(ctx context.Context, s *session, deliveries <-chan amqp.Delivery) <-chan struct{} {
	groups := make(chan []*amqp.Delivery)
	ex := newExecuting()
	go c.collect(s.stop, deliveries, groups, ex)
	var wg sync.WaitGroup
	for range c.cfg.Concurrency {
		wg.Go(func() { c.executeGroups(ctx, s, groups, ex) })
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	return done
}

// A unit is work an executor runs: items to take through claim → execute
// → commit → settle, under the runner r. A group becomes one unit; the
// items of a whole group that failed are re-queued as a unit of their own
// (isolated, their keys still claimed when the key holder keeps them over a
// rollback), and so are the repeats of a key within a group.
type unit struct {
	items []*item
	r     runner
	// prepared: the items' claims are read (prepare); claimed: their keys
	// are acquired too.
	prepared, claimed bool
}

// processGroup takes a group of deliveries to their outcomes.
func (c *Consumer) processGroup(ctx context.Context, s *session, ds []*amqp.Delivery) {
	items := make([]*item, 0, len(ds))
	for _, d := range ds {
		items = append(items, c.begin(ctx, d))
	}
	c.processItems(ctx, s, items)
}

// processItems takes the items of a group, just begun, to their outcomes:
// the group's unit, then each unit it re-queues, in turn.
func (c *Consumer) processItems(ctx context.Context, s *session, items []*item) {
	queue := []unit{{items: items, r: c.runner}}
	for len(queue) > 0 {
		next := c.process(ctx, s, queue[0])
		queue = append(next, queue[1:]...)
	}
}

// process takes one unit through the pipeline's stages and returns the
// units it re-queues: its whole group that failed, to run isolated, then
// the repeats of a key within it, which run once it settled (they find a
// duplicate, or the key free again).
func (c *Consumer) process(ctx context.Context, s *session, u unit) []unit {
	for _, it := range u.items {
		it.queued = false // this unit finishes it, unless it queues it again
	}
	items, repeats := u.items, []*item(nil)
	if !u.prepared {
		items, repeats = c.prepareAll(s, u.items)
	}
	var next []unit
	if again := c.execute(ctx, s, u, items); again != nil {
		next = append(next, *again)
	}
	s.flush()
	for _, it := range u.items {
		if !it.queued {
			c.finish(it)
		}
	}
	if len(repeats) > 0 {
		again := make([]*item, len(repeats))
		for i, it := range repeats {
			it.span.End() // the next round starts a span of its own
			again[i] = c.begin(ctx, it.d)
		}
		next = append(next, unit{items: again, r: c.runner})
	}
	return next
}

// prepareAll reads the items' claims (prepare, which settles those that
// cannot be claimed) and returns the claimable ones and the repeats of a
// key another item of the group claims.
func (c *Consumer) prepareAll(s *session, items []*item) (claimable, repeats []*item) {
	seen := map[[2]string]bool{}
	for _, it := range items {
		if !c.prepare(s, it) {
			continue
		}
		k := [2]string{it.claim.Tenant, it.claim.Key}
		if seen[k] {
			it.queued = true
			repeats = append(repeats, it)
			continue
		}
		seen[k] = true
		claimable = append(claimable, it)
	}
	return claimable, repeats
}

// execute is the one path of a unit's items, whatever the mode: claim
// their keys, run them under the unit's runner in one transaction, commit
// it once, release what failed and settle each item. The key holder and
// the runner, chosen by New, make the differences. A whole group whose
// run failed is rolled back and returned, to run again isolated.
func (c *Consumer) execute(ctx context.Context, s *session, u unit, items []*item) (again *unit) {
	var tx pgx.Tx
	if !u.claimed {
		tx, items = c.claim(ctx, s, items)
		if len(items) == 0 {
			return nil
		}
	}
	if tx != nil {
		// After the commit, a no-op; also when the test kit crashes the group.
		defer c.rollback(ctx, tx)
	}
	if !u.claimed {
		c.stage(kit.StageAfterReserve, items, tx)
	}
	done := c.handling(ctx, items)
	defer func() { done(again != nil && again.claimed) }()
	stop := c.holder.watch(ctx, items)
	defer stop() // also when the test kit crashes the group (crash.go)
	t0 := time.Now()
	results, ok := c.runGroup(ctx, tx, u.r, items)
	c.metrics.handlerTime.Record(ctx, time.Since(t0).Seconds(), c.metrics.with())
	if !ok {
		return c.requeue(ctx, tx, items)
	}
	c.stageCommitting(kit.StageAfterCommit, items, results)
	c.holder.release(ctx, items, results)
	c.settle(s, items, results)
	return nil
}

// requeue rolls back a whole group whose run failed and returns its items
// as a unit to run isolated: with their keys still claimed when the key
// holder keeps them over the rollback (leases), else to claim again (held
// keys went with the rollback).
func (c *Consumer) requeue(ctx context.Context, tx pgx.Tx, items []*item) *unit {
	if tx != nil {
		c.rollback(ctx, tx)
	}
	for _, it := range items {
		it.queued = true
	}
	return &unit{items: items, r: c.isolated, prepared: true, claimed: c.holder.kept()}
}

// runGroup runs the items under r in tx (nil: a transaction of its own)
// and commits it once. ok false: nothing committed and nothing is decided;
// the items must run again isolated.
func (c *Consumer) runGroup(ctx context.Context, tx pgx.Tx, r runner, items []*item) (results []groupResult, ok bool) {
	if tx == nil {
		var err error
		if tx, err = c.beginGroup(ctx); err != nil {
			return failAll(make([]groupResult, len(items)), err), true
		}
		defer c.rollback(ctx, tx)
	}
	for _, it := range items {
		it.del.tx = tx // a crash in one of its steps abandons it too
	}
	g, results, ok := r.run(ctx, tx, items)
	if !ok {
		return nil, false
	}
	return c.commit(ctx, g, r, items, results)
}

// commit writes the group's outbox rows, completes the keys the runner did
// not complete (one statement), gives up in the transaction the keys it
// holds whose items failed, commits (the one commit of every mode), and
// then wakes the relays of the outbox rows it wrote. ok
// false: a whole group's completion failed (a lease lost); nothing
// committed.
func (c *Consumer) commit(ctx context.Context, g *groupTx, r runner, items []*item, results []groupResult) ([]groupResult, bool) {
	cctx, span := c.groupSpan(ctx, items, r.commitSpan(), "idemq complete")
	defer span.End()
	fail := func(err error) []groupResult {
		span.SetStatus(codes.Error, redact.Error(err))
		return failAll(results, err)
	}
	// The outbox rows wake the relays after the commit (outbox.Wake
	// below), not with a NOTIFY in it: a NOTIFY would make the commits of
	// every group wait in line for Postgres' notify lock.
	cctx = outbox.WakeAfterCommit(cctx)
	if err := c.writeOutbox(cctx, g); err != nil {
		return fail(err), true
	}
	var (
		leases []*dedup.Lease
		rs     []dedup.Result
	)
	for i, it := range items {
		if r := results[i]; r.err == nil && !r.completed {
			leases, rs = append(leases, it.lease), append(rs, r.result)
		}
	}
	if len(leases) > 0 {
		if lost, err := c.complete(cctx, g.tx, nil, leases, rs); err != nil {
			if len(leases) > 1 {
				span.AddEvent("idemq.group_isolated", trace.WithAttributes(attribute.Int("idemq.leases_lost", lost)))
				return nil, false
			}
			return fail(err), true
		}
	}
	gaveUp, err := c.holder.giveUp(cctx, g.tx, items, results)
	if err != nil {
		return fail(err), true
	}
	if !succeeded(results) && !gaveUp {
		// Nothing to commit: the rollback drops what a failed handler wrote
		// (one that ran without a savepoint).
		return results, true
	}
	c.stageCommitting(kit.StageBeforeCommit, items, results, g.tx)
	if err := c.commitTx(cctx, g.tx); err != nil {
		// The commit's fate is unknown: the keys are released (a no-op for
		// those it did complete) and retried; a retry is a duplicate if it
		// committed.
		span.SetStatus(codes.Error, redact.Error(err))
		for i := range results {
			results[i] = groupResult{err: fmt.Errorf("commit: %w", err)}
		}
		return results, true
	}
	outbox.Wake(cctx)
	return results, true
}

// complete completes the keys of leases with results in tx, with one
// statement: the single-key one for one key (after the owed savepoint of
// sp, if any, in the same round trip; a held key whose result is the
// presumed one sends nothing), else the batch one. An error wrapping
// dedup.ErrLeaseLost says how many leases were lost.
func (c *Consumer) complete(ctx context.Context, tx pgx.Tx, sp *savepoints, leases []*dedup.Lease, results []dedup.Result) (lost int, err error) {
	cctx, cancel := c.storeCtx(ctx)
	defer cancel()
	if len(leases) > 1 {
		gone, err := c.protocol.CompleteBatch(cctx, tx, leases, results)
		if err == nil && len(gone) > 0 {
			err = fmt.Errorf("%d of the group's leases: %w", len(gone), dedup.ErrLeaseLost)
		}
		return len(gone), err
	}
	done := &pgx.Batch{}
	if err := c.protocol.QueueComplete(done, leases[0], results[0]); err != nil || done.Len() == 0 {
		return 0, err
	}
	if sp == nil {
		sp = &savepoints{tx: tx} // owes none
	}
	b := &pgx.Batch{}
	sp.queueOwed(b)
	b.QueuedQueries = append(b.QueuedQueries, done.QueuedQueries...)
	err = sp.send(cctx, b, func(pgx.BatchResults) error { return nil })
	if errors.Is(err, dedup.ErrLeaseLost) {
		return 1, err
	}
	return 0, err
}

// failedKeys returns the leases of the items whose run did not commit and
// whose lease is not lost, each with the reason settleFailure routes its
// delivery by, so that a key given up on reads as released by
// permanent_error or max_attempts_exceeded.
func (c *Consumer) failedKeys(items []*item, results []groupResult) (leases []*dedup.Lease, reasons []string) {
	for i, it := range items {
		if r := results[i]; r.err != nil && !errors.Is(r.err, dedup.ErrLeaseLost) {
			leases = append(leases, it.lease)
			reasons = append(reasons, c.releaseReason(it, r.err, r.bystander))
		}
	}
	return leases, reasons
}

// claim reserves the items' keys with one statement, in the transaction
// the key holder opens for it (held keys), else on its own, and settles the
// items that did not acquire theirs; it returns that transaction (nil for
// leased keys) and the acquired items, in the global key order that batch
// reservations lock in (so that two groups never wait on each other in a
// cycle).
func (c *Consumer) claim(ctx context.Context, s *session, items []*item) (pgx.Tx, []*item) {
	if len(items) == 0 {
		return nil, nil
	}
	tx, err := c.holder.begin(ctx)
	if err != nil {
		c.reserveFailed(s, items, err)
		return nil, nil
	}
	claims := make([]dedup.Claim, len(items))
	for i, it := range items {
		claims[i] = it.claim
	}
	rctx, cancel := c.storeCtx(ctx)
	defer cancel()
	rctx, rspan := c.groupSpan(rctx, items, "idemq reserve batch", "idemq reserve")
	rspan.SetAttributes(attribute.Int("idemq.batch.size", len(claims)), attribute.Bool("idemq.reserve.in_tx", tx != nil))
	t0 := time.Now()
	res, err := c.holder.reserve(rctx, tx, claims)
	c.metrics.reserveTime.Record(ctx, time.Since(t0).Seconds(), c.metrics.with())
	if err == nil && len(items) == 1 {
		rspan.SetAttributes(attribute.String("idemq.decision", res[0].Decision.String()))
	}
	if err != nil {
		rspan.SetStatus(codes.Error, redact.Error(err))
	}
	rspan.End()
	if err != nil {
		if tx != nil {
			c.rollback(ctx, tx)
		}
		if tx != nil && rctx.Err() != nil {
			// A held reservation waits for the transactions that hold the
			// same keys: they are busy elsewhere, not failing.
			for _, it := range items {
				it.ev.Outcome = OutcomeInProgress
				c.retryLater(s, it, c.topo.tierAtLeast(busyRecheck), fmt.Errorf("%w: %w", errReserve, err))
			}
			return nil, nil
		}
		c.reserveFailed(s, items, err)
		return nil, nil
	}
	var acquired []*item
	for i, it := range items {
		if it.span.IsRecording() {
			it.span.AddEvent("idemq reserve", trace.WithAttributes(attribute.String("idemq.decision", res[i].Decision.String())))
		}
		if c.decide(s, it, res[i]) {
			acquired = append(acquired, it)
		}
	}
	if len(acquired) == 0 && tx != nil {
		c.rollback(ctx, tx)
		return nil, nil
	}
	slices.SortFunc(acquired, func(a, b *item) int {
		return cmp.Or(cmp.Compare(a.claim.Tenant, b.claim.Tenant), cmp.Compare(a.claim.Key, b.claim.Key))
	})
	return tx, acquired
}

// reserveFailed routes items whose keys could not be reserved (the key
// store unreachable, its schema missing): an infrastructure failure.
func (c *Consumer) reserveFailed(s *session, items []*item, err error) {
	for _, it := range items {
		rerr := fmt.Errorf("%w: %w", errReserve, err)
		c.retryOrDeadLetter(s, it, rerr)
		c.logFailure("reserve failed", it, rerr)
	}
}

// groupResult is one acquired item's fate inside the shared transaction.
type groupResult struct {
	result dedup.Result
	err    error
	// completed: the key is completed in the transaction already (above
	// the item's savepoint); the others that succeeded are completed at
	// the commit.
	completed bool
	// bystander: the item failed only because a group-mate broke the shared
	// transaction; it retries without counting an attempt.
	bystander bool
}

// settle gives each executed item its outcome from its result.
func (c *Consumer) settle(s *session, items []*item, results []groupResult) {
	for i, it := range items {
		if r := results[i]; r.err != nil {
			c.settleFailure(s, it, r.err, r.bystander)
		} else {
			c.settleSuccess(s, it, &r.result)
		}
	}
}

// handling counts the items in progress and gives each its handler context
// (cancelled with a cause when its lease is lost), unless it has one; the
// returned function ends both, but for the handler contexts it keeps (the
// items run again under the leases they have).
func (c *Consumer) handling(ctx context.Context, items []*item) (done func(keep bool)) {
	n := int64(len(items))
	c.inFlight.Add(n)
	c.metrics.inProgress.Add(ctx, n, c.metrics.with())
	for _, it := range items {
		switch {
		case it.hctx != nil:
		case !c.holder.kept():
			// Held keys cannot be lost on their own (the transaction's
			// row locks are the leases): the delivery's context is the
			// handler's.
			it.hctx, it.hcancel = it.ctx, noCancel
		default:
			it.hctx, it.hcancel = context.WithCancelCause(it.ctx)
		}
	}
	return func(keep bool) {
		for _, it := range items {
			if !keep {
				it.hcancel(nil)
				it.hctx, it.hcancel = nil, nil
			}
		}
		c.inFlight.Add(-n)
		c.metrics.inProgress.Add(context.WithoutCancel(ctx), -n, c.metrics.with())
	}
}

// noCancel is the handler context's cancel of an item whose key is held in
// the group's transaction.
func noCancel(error) {}

// groupSpan starts a span of the group's work: alone, a child of the
// delivery's process span named alone; a group's, which belongs to no
// single trace, named group and linked to each delivery. The span keeps
// ctx's deadline and cancellation.
func (c *Consumer) groupSpan(ctx context.Context, items []*item, group, alone string) (context.Context, trace.Span) {
	if len(items) == 1 {
		_, span := c.tracer.Start(items[0].ctx, alone)
		return trace.ContextWithSpan(ctx, span), span
	}
	return c.tracer.Start(ctx, group, groupLinks(items))
}

// groupLinks links a span of a whole group, which belongs to no single
// delivery's trace, to the process span of each delivery of the group.
func groupLinks(items []*item) trace.SpanStartOption {
	var links []trace.Link
	for _, it := range items {
		l := trace.LinkFromContext(it.ctx)
		if !l.SpanContext.IsValid() {
			continue // no tracing (a no-op provider): nothing to link to
		}
		if links == nil {
			links = make([]trace.Link, 0, len(items))
		}
		links = append(links, l)
	}
	return trace.WithLinks(links...)
}

// bodyBytes is the size of the deliveries' bodies.
func bodyBytes(ds []*amqp.Delivery) int64 {
	var n int64
	for _, d := range ds {
		n += int64(len(d.Body))
	}
	return n
}

// errReserve marks the failure of a reservation (the key store unreachable,
// its schema missing).
var errReserve = errors.New("reserve")
