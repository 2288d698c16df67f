package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer/internal/kit"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/redact"
)

// Every delivery goes through one pipeline, whatever the mode:
//
//	collect  one accumulator per session forms groups of up to Group.Size
//	         deliveries (Group.Linger waits for a group to fill) and hands each
//	         to the first of Concurrency executors that is free; a group of
//	         one is the per-message mode.
//	claim    each delivery's key, tenant and fingerprint are read (prepare),
//	         the group's keys are reserved with one statement, in the group's
//	         transaction (held: the row lock is the lease) unless
//	         SeparateReservations, and what is not acquired (duplicate, busy,
//	         key reuse) is settled at once (run, claimAndExecute, claim).
//	execute  the acquired items run under the consumer's strategy (isolated,
//	         optimistic, batch; see strategy.go), in one transaction with one
//	         commit; separate leases are extended by one heartbeat, which
//	         cancels exactly the items whose lease was lost.
//	settle   each item gets its outcome: acked after the commit, or replaced by
//	         a retry or dead-letter copy the broker confirmed (settle.go).

// collect forms groups from in and hands them to out until in closes or
// stop is closed; then it closes out. A group goes when it is full, or when
// an executor is free and the group's linger is over (or there is none).
// While every executor is busy the group keeps filling, so groups grow with
// the load. Deliveries of a group not yet handed over when it stops are
// never acked: the broker redelivers them.
func (c *Consumer) collect(stop <-chan struct{}, in <-chan amqp.Delivery, out chan<- []*amqp.Delivery) {
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
		if len(group) >= size || (len(group) > 0 && ready) {
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
			group, ready, linger = nil, false, nil
			if timer != nil {
				timer.Stop()
			}
		case <-linger:
			ready, linger = true, nil
		case <-stop:
			return
		}
	}
}

// execute runs groups from in until it closes, then returns.
func (c *Consumer) executeGroups(ctx context.Context, s *session, in <-chan []*amqp.Delivery) {
	for group := range in {
		c.processGroup(ctx, s, group)
		s.budget.give(bodyBytes(group))
	}
}

// runPipeline starts the collector and the executors of one session; the
// returned channel is closed once every executor has returned.
func (c *Consumer) runPipeline(ctx context.Context, s *session, deliveries <-chan amqp.Delivery) <-chan struct{} {
	groups := make(chan []*amqp.Delivery)
	go c.collect(s.stop, deliveries, groups)
	var wg sync.WaitGroup
	for range c.cfg.Concurrency {
		wg.Go(func() { c.executeGroups(ctx, s, groups) })
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	return done
}

// processGroup takes a group of deliveries to their outcomes: one reserve
// statement, one transaction, one commit.
func (c *Consumer) processGroup(ctx context.Context, s *session, ds []*amqp.Delivery) {
	items := make([]*item, 0, len(ds))
	for _, d := range ds {
		items = append(items, c.begin(ctx, d))
	}
	c.processItems(ctx, s, items)
}

// processItems takes the items of a group, just begun, to their outcomes.
func (c *Consumer) processItems(ctx context.Context, s *session, items []*item) {
	// Claim what can be claimed; repeats of a key within the group wait for
	// the group to end and then run as a group of their own (they find a
	// duplicate, or the key free again).
	var claimable, repeats []*item
	seen := map[[2]string]bool{}
	for _, it := range items {
		if !c.prepare(s, it) {
			continue
		}
		k := [2]string{it.claim.Tenant, it.claim.Key}
		if seen[k] {
			it.repeat = true
			repeats = append(repeats, it)
			continue
		}
		seen[k] = true
		claimable = append(claimable, it)
	}
	c.run(ctx, s, claimable)
	s.flush()
	for _, it := range items {
		if !it.repeat {
			c.finish(it)
		}
	}
	if len(repeats) > 0 {
		again := make([]*amqp.Delivery, len(repeats))
		for i, it := range repeats {
			it.span.End() // the next round starts a span of its own
			again[i] = it.d
		}
		c.processGroup(ctx, s, again)
	}
}

// run claims the items' keys and executes the items that acquired theirs.
// Unless Config.SeparateReservations, the keys are reserved inside the
// group's own transaction (held: see dedup.Store.ReserveBatchTx), so that
// the reservations, the effects and the completions commit once; a held
// group that must run another way (a whole group whose handler failed; a
// handler that calls Step, which needs a lease others can see) rolls back
// and is claimed again, as execute says.
func (c *Consumer) run(ctx context.Context, s *session, items []*item) {
	st := c.strategy
	for len(items) > 0 {
		items, st = c.claimAndExecute(ctx, s, items, st)
	}
}

// claimAndExecute is one round of run: it claims the items' keys (in the
// group's transaction when it holds them) and executes the acquired items
// under st; it returns what execute returns.
func (c *Consumer) claimAndExecute(ctx context.Context, s *session, items []*item, st strategy) ([]*item, strategy) {
	var held pgx.Tx
	if c.holdsKeys() {
		var err error
		if held, err = c.beginHeld(ctx); err != nil {
			c.reserveFailed(s, items, err)
			return nil, st
		}
		// After the commit, a no-op; also when the test kit crashes the group.
		defer c.rollback(ctx, held)
	}
	acquired := c.claim(ctx, s, items, held)
	if len(acquired) == 0 {
		return nil, st
	}
	c.crashAt(kit.StageAfterReserve, "", acquired, held)
	return c.execute(ctx, s, acquired, held, st)
}

// sawSteps records that a handler called Delivery.Step in a group that
// held its keys. Steps need leases others can see: from now on every group
// reserves its keys separately.
func (c *Consumer) sawSteps() {
	if c.stepsSeen.CompareAndSwap(false, true) {
		c.log.Info("the handler runs steps: groups reserve their keys separately from now on")
	}
}

// holdsKeys reports whether groups reserve their keys in their own
// transaction.
func (c *Consumer) holdsKeys() bool {
	return !c.cfg.SeparateReservations && !c.stepsSeen.Load()
}

// claim reserves the items' keys with one statement, in held (the group's
// transaction) or, when nil, on its own, and settles the items that did not
// acquire theirs; it returns the acquired ones, in the global key order that
// batch reservations lock in (so that two groups never wait on each other
// in a cycle).
func (c *Consumer) claim(ctx context.Context, s *session, items []*item, held pgx.Tx) []*item {
	if len(items) == 0 {
		return nil
	}
	claims := make([]dedup.Claim, len(items))
	for i, it := range items {
		claims[i] = it.claim
	}
	rctx, cancel := c.storeCtx(ctx)
	defer cancel()
	rctx, rspan := c.groupSpan(rctx, items, "idemq reserve batch", "idemq reserve")
	rspan.SetAttributes(attribute.Int("idemq.batch.size", len(claims)), attribute.Bool("idemq.reserve.in_tx", held != nil))
	t0 := time.Now()
	res, err := c.reserve(rctx, held, claims)
	c.metrics.reserveTime.Record(ctx, time.Since(t0).Seconds(), c.metrics.with())
	if err == nil && len(items) == 1 {
		rspan.SetAttributes(attribute.String("idemq.decision", res[0].Decision.String()))
	}
	if err != nil {
		rspan.SetStatus(codes.Error, redact.Error(err))
	}
	rspan.End()
	if err != nil {
		if held != nil && rctx.Err() != nil {
			// A held reservation waits for the transactions that hold the
			// same keys: they are busy elsewhere, not failing.
			for _, it := range items {
				it.ev.Outcome = OutcomeInProgress
				c.retryLater(s, it, c.topo.tierAtLeast(busyRecheck), fmt.Errorf("%w: %w", errReserve, err))
			}
			return nil
		}
		c.reserveFailed(s, items, err)
		return nil
	}
	var acquired []*item
	for i, it := range items {
		it.span.AddEvent("idemq reserve", trace.WithAttributes(attribute.String("idemq.decision", res[i].Decision.String())))
		if c.decide(s, it, res[i]) {
			acquired = append(acquired, it)
		}
	}
	slices.SortFunc(acquired, func(a, b *item) int {
		return cmp.Or(cmp.Compare(a.claim.Tenant, b.claim.Tenant), cmp.Compare(a.claim.Key, b.claim.Key))
	})
	return acquired
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

// reserve reserves the claims with one statement, in held when it is not
// nil: the single-key one for a group of one (no arrays to build and sort),
// else the batch one.
func (c *Consumer) reserve(ctx context.Context, held pgx.Tx, claims []dedup.Claim) ([]dedup.Reservation, error) {
	var (
		r   dedup.Reservation
		err error
	)
	switch {
	case len(claims) > 1 && held != nil:
		return c.store.ReserveBatchTx(ctx, held, claims)
	case len(claims) > 1:
		return c.store.ReserveBatch(ctx, claims)
	case held != nil:
		r, err = c.store.ReserveTx(ctx, held, claims[0])
	default:
		r, err = c.store.Reserve(ctx, claims[0])
	}
	return []dedup.Reservation{r}, err
}

// groupResult is one acquired item's fate inside the shared transaction.
type groupResult struct {
	result dedup.Result
	err    error
	// bystander: the item failed only because a group-mate broke the shared
	// transaction; it retries without counting an attempt.
	bystander bool
}

// execute runs the acquired items under strategy st in held, the group's
// transaction that holds their keys, or (nil) in a transaction of its own
// while one heartbeat extends their separate leases, and settles each item.
// A held isolated group's items whose handler called Step leave its commit
// with leases others can see, and run again under them. A held group whose
// whole run failed cannot run again as it is (its keys went with the
// rollback): execute returns its items, to be claimed again, with the
// strategy to run them under.
func (c *Consumer) execute(ctx context.Context, s *session, items []*item, held pgx.Tx, st strategy) ([]*item, strategy) {
	defer c.handling(ctx, items)()
	if held == nil {
		stop := c.heartbeat(ctx, items)
		defer stop() // also when the test kit crashes the group (crash.go)
	}
	t0 := time.Now()
	results, next := c.attempt(ctx, items, held, st)
	c.metrics.handlerTime.Record(ctx, time.Since(t0).Seconds(), c.metrics.with())
	if results == nil {
		return items, next
	}
	var steppers []*item
	if held != nil {
		n := 0
		for i, it := range items {
			if errors.Is(results[i].err, ErrStepInBatch) {
				if !it.lease.HeldByTransaction() {
					steppers = append(steppers, it) // leased by the commit
					continue
				}
				// The group did not commit: its key went with the rollback.
				results[i].bystander = true
			}
			items[n], results[n] = it, results[i]
			n++
		}
		items, results = items[:n], results[:n]
	}
	c.crashAt(kit.StageAfterCommit, "", committing(items, results))
	c.releaseFailed(ctx, items, results)
	c.settle(s, items, results)
	if len(steppers) > 0 {
		c.sawSteps()
		return c.execute(ctx, s, steppers, nil, next)
	}
	return nil, next
}

// attempt runs the items under st in held, or in transactions of its own:
// a whole group that fails runs again isolated, in a new transaction. A
// held group cannot: its keys went with the rollback, and attempt returns no
// results and the strategy to claim the items again with.
func (c *Consumer) attempt(ctx context.Context, items []*item, held pgx.Tx, st strategy) ([]groupResult, strategy) {
	for tx := held; ; tx = nil {
		results, err := c.runIn(ctx, tx, items, st)
		if err == nil {
			return results, st
		}
		if errors.Is(err, ErrStepInBatch) {
			c.sawSteps()
		} else {
			st = isolated{c}
		}
		if held != nil {
			return nil, st
		}
	}
}

// runIn runs the items under st in tx, or (nil) in a transaction of its
// own; the transaction is rolled back unless st committed it.
func (c *Consumer) runIn(ctx context.Context, tx pgx.Tx, items []*item, st strategy) ([]groupResult, error) {
	if tx == nil {
		var err error
		if tx, err = c.beginGroup(ctx); err != nil {
			return failAll(make([]groupResult, len(items)), err), nil
		}
	}
	// After the commit, a no-op; also when the test kit crashes the group.
	defer c.rollback(ctx, tx)
	return st.run(ctx, tx, items)
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
// (cancelled with a cause when its lease is lost); the returned function
// ends both.
func (c *Consumer) handling(ctx context.Context, items []*item) (done func()) {
	n := int64(len(items))
	c.inFlight.Add(n)
	c.metrics.inProgress.Add(ctx, n, c.metrics.with())
	for _, it := range items {
		it.hctx, it.hcancel = context.WithCancelCause(it.ctx)
	}
	return func() {
		for _, it := range items {
			it.hcancel(nil)
		}
		c.inFlight.Add(-n)
		c.metrics.inProgress.Add(context.WithoutCancel(ctx), -n, c.metrics.with())
	}
}

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
	links := make([]trace.Link, 0, len(items))
	for _, it := range items {
		links = append(links, trace.LinkFromContext(it.ctx))
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
