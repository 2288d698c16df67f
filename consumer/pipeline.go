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

	"github.com/idemq/idemq/consumer/internal/kit"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/redact"
)

// Every delivery goes through one pipeline, whatever the mode:
//
//	collect  one accumulator per session forms groups of up to GroupSize
//	         deliveries (GroupLinger waits for a group to fill) and hands each
//	         to the first of Concurrency executors that is free; a group of
//	         one is the per-message mode.
//	claim    each delivery's key, tenant and fingerprint are read (prepare),
//	         the group's keys are reserved with one statement, and what is not
//	         acquired (duplicate, busy, key reuse) is settled at once.
//	execute  the acquired items run under the consumer's strategy (isolated,
//	         optimistic, batch; see strategy.go), in one transaction with one
//	         commit, while one heartbeat extends their leases and cancels
//	         exactly the items whose lease was lost.
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
	size := c.cfg.GroupSize
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
		if c.cfg.GroupLinger <= 0 || size == 1 {
			ready = true
			return
		}
		timer = time.NewTimer(c.cfg.GroupLinger)
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
	if !c.claimInTx || c.stepsSeen.Load() || !c.runInTx(ctx, s, claimable) {
		if acquired := c.claim(ctx, s, claimable); len(acquired) > 0 {
			for _, it := range acquired {
				c.crashAt(it.ctx, kit.StageAfterReserve, "")
			}
			c.execute(ctx, s, acquired)
		}
	}
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

// claim reserves the items' keys with one statement and settles the items
// that did not acquire theirs; it returns the acquired ones, in the global
// key order that batch reservations lock in (so that two groups never wait
// on each other in a cycle).
func (c *Consumer) claim(ctx context.Context, s *session, items []*item) []*item {
	if len(items) == 0 {
		return nil
	}
	claims := make([]dedup.Claim, len(items))
	for i, it := range items {
		claims[i] = it.claim
	}
	// Alone, the reservation is a child of the delivery's process span; a
	// group's belongs to no single trace and links to each delivery.
	parent, name, opts := ctx, "idemq reserve batch", []trace.SpanStartOption{groupLinks(items)}
	if len(items) == 1 {
		parent, name, opts = items[0].ctx, "idemq reserve", nil
	}
	rctx, cancel := c.storeCtx(parent)
	defer cancel()
	rctx, rspan := c.tracer.Start(rctx, name, opts...)
	rspan.SetAttributes(attribute.Int("idemq.batch.size", len(claims)))
	t0 := time.Now()
	res, err := c.reserve(rctx, claims)
	c.metrics.reserveTime.Record(ctx, time.Since(t0).Seconds(), c.metrics.with())
	if err == nil && len(items) == 1 {
		rspan.SetAttributes(attribute.String("idemq.decision", res[0].Decision.String()))
	}
	if err != nil {
		rspan.SetStatus(codes.Error, redact.Error(err))
	}
	rspan.End()
	if err != nil {
		// The key store is unreachable: an infrastructure failure.
		for _, it := range items {
			rerr := fmt.Errorf("%w: %w", errReserve, err)
			c.retryOrDeadLetter(s, it, rerr)
			c.logFailure("reserve failed", it, rerr)
		}
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

// reserve reserves the claims with one statement: the single-key one for
// a group of one (no arrays to build and sort), else the batch one.
func (c *Consumer) reserve(ctx context.Context, claims []dedup.Claim) ([]dedup.Reservation, error) {
	if len(claims) == 1 {
		r, err := c.store.Reserve(ctx, claims[0])
		return []dedup.Reservation{r}, err
	}
	return c.store.ReserveBatch(ctx, claims)
}

// groupResult is one acquired item's fate inside the shared transaction.
type groupResult struct {
	result dedup.Result
	err    error
	// bystander: the item failed only because a group-mate broke the shared
	// transaction; it retries without counting an attempt.
	bystander bool
}

// execute runs the acquired items under the consumer's strategy, with one
// heartbeat for their leases, and settles each.
func (c *Consumer) execute(ctx context.Context, s *session, items []*item) {
	defer c.handling(ctx, items)()
	stop := c.heartbeat(ctx, items)
	t0 := time.Now()
	results := c.strategy.run(ctx, items)
	c.metrics.handlerTime.Record(ctx, time.Since(t0).Seconds(), c.metrics.with())
	stop()
	c.releaseFailed(ctx, items, results)
	c.settle(s, items, results)
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
