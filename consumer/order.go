package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/ordering"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/internal/wire"
)

// The headers of ordered messages (DESIGN section 12).
const (
	// HeaderOrderingKey names the entity whose messages take effect in
	// order; a partitioned queue's exchange hashes it.
	HeaderOrderingKey = wire.HeaderOrderingKey
	// HeaderSequence is a message's position among its ordering key's
	// messages, counting from 1 with no gap.
	HeaderSequence = wire.HeaderSequence
)

// The reasons of ordered consumption's dead letters.
const (
	// ReasonSequenceGap: the message came before a sequence of its key that
	// did not arrive within Ordering.GapTimeout (or the waiting room,
	// Ordering.MaxWaiting, was full); its key is blocked.
	ReasonSequenceGap = wire.ReasonSequenceGap
	// ReasonSequenceInvalid: x-ordering-key or x-sequence is not what
	// DESIGN section 12 says (text; an integer from 1, beside a key).
	ReasonSequenceInvalid = wire.ReasonSequenceInvalid
)

// MaxGapTimeout bounds Ordering.GapTimeout: a waiting message is an
// unacknowledged delivery, which RabbitMQ's consumer_timeout (30 minutes
// by default) would end by closing the channel.
const MaxGapTimeout = 25 * time.Minute

// OutcomeWaiting: an ordered message came before a sequence of its key
// that is not applied yet; it waits, unacknowledged and not run, for it.
const OutcomeWaiting = dedup.OutcomeWaiting

// Ordering keeps each ordering key's messages in order (Config.Ordering,
// docs/ordering.md). Messages of one key run one at a time, in the order
// they arrive; a failed one that goes to a retry tier holds its key's later
// messages until it comes back. With x-sequence, the last sequence applied
// per (consumer, tenant, ordering key) commits in the handler's
// transaction: a sequence at or below it is a duplicate (acked, not run), a
// later one than the next waits for the gap to fill.
type Ordering struct {
	// GapTimeout is how long a message waits for its predecessor (a
	// sequence's gap, or a retried message of its key to come back) before
	// it is dead-lettered sequence_gap and its key blocked. Default
	// DefaultGapTimeout; at most MaxGapTimeout. Make it longer than the
	// retry tiers' delays, so that a retried predecessor is waited for.
	GapTimeout time.Duration
	// MaxWaiting bounds the messages waiting for a gap at once in the
	// consumer: they hold prefetch slots, and a full prefetch would keep
	// out the very message they wait for. Past it, an early message waits
	// in a retry tier instead (a copy, confirmed, then the ack; no attempt
	// counts) and is looked at again when it comes back; its GapTimeout
	// counts from the first time it was found early. Default half the
	// prefetch.
	MaxWaiting int
}

// errEarly is a handler run's failure when its sequence is not the next:
// the message waits (it is not retried and no attempt counts).
type errEarly struct {
	seq, last int64
}

func (e *errEarly) Error() string {
	return fmt.Sprintf("sequence %d came before %d (the last applied is %d)", e.seq, e.last+1, e.last)
}

// errGap: a message waited longer than GapTimeout for its predecessor.
var errGap = errors.New("the sequence before it did not arrive in time")

// orderState is what the handler's wrapper knows of a delivery's place.
type orderState struct {
	wire.Ordering
	// expired: it waited its GapTimeout; if still early, it goes to the DLQ.
	expired bool
	// applied: its sequence was applied already; nothing ran.
	applied bool
	// waitingSince is when it was first found early, carried by the copy
	// that took it round a retry tier (zero: not found early before).
	waitingSince time.Time
	// circled: found early with the waiting room full, it went round a
	// retry tier rather than wait in the gate.
	circled bool
	// gate is the session's, which learns how the delivery ended.
	gate *orderGate
}

// ordered wraps h: with a sequence, the key's row decides in the handler's
// transaction whether h runs (the next sequence: it runs, and the row
// advances with its effects), is skipped (applied already: a duplicate) or
// waits (early).
func (c *Consumer) ordered(h Handler) Handler {
	schema := c.store.Config().Schema
	return func(ctx context.Context, tx pgx.Tx, d *Delivery) (Response, error) {
		o := d.order
		if o == nil || o.Sequence == 0 {
			return h(ctx, tx, d)
		}
		scope := ordering.Scope{Consumer: c.cfg.Name, Tenant: d.Tenant, Key: o.Key}
		verdict, last, err := ordering.Advance(ctx, tx, schema, scope, o.Sequence)
		switch {
		case err != nil:
			return Response{}, err
		case verdict == ordering.Applied:
			o.applied = true
			return Response{}, nil
		case verdict == ordering.Early && o.expired:
			return Response{}, Permanent(fmt.Errorf("%w: %w", errGap, &errEarly{o.Sequence, last}))
		case verdict == ordering.Early:
			return Response{}, &errEarly{o.Sequence, last}
		}
		return h(ctx, tx, d)
	}
}

// readOrdering gives it its place in its key's order (an ordered
// consumer's deliveries), or says what is wrong with its headers.
func (c *Consumer) readOrdering(s *session, it *item) error {
	o, err := wire.ReadOrdering(it.d.Headers)
	if err != nil {
		return err
	}
	if o.Key != "" {
		it.order = &orderState{Ordering: o, gate: s.gate}
		if since, ok := wire.String(it.d.Headers[wire.HeaderWaitingSince]); ok && it.verified {
			it.order.waitingSince, _ = time.Parse(time.RFC3339Nano, since)
		}
		if s.gate != nil {
			it.order.expired = s.gate.takeExpired(it.d.DeliveryTag) ||
				!it.order.waitingSince.IsZero() && time.Since(it.order.waitingSince) >= s.gate.timeout
		}
	}
	return nil
}

// since is when the delivery started waiting for its predecessor: when it
// was first found early, or now.
func (o *orderState) since(now time.Time) time.Time {
	if o.waitingSince.IsZero() {
		return now
	}
	return o.waitingSince
}

// circle sends an early delivery round a retry tier, the waiting room being
// full: a copy that carries when it was first found early, then the ack. No
// attempt counts. The tier grows with the time it has waited.
func (c *Consumer) circle(s *session, it *item, early *errEarly) {
	now := time.Now()
	since := it.order.since(now)
	it.order.circled = true
	it.ev.Outcome = OutcomeWaiting
	it.ev.Err = early
	headers := wire.RetryHeaders(it.attempt)
	headers[wire.HeaderWaitingSince] = since.UTC().Format(time.RFC3339Nano)
	c.publishThenAck(s, it, "", c.topo.tierAtLeast(now.Sub(since)/2), headers, "idemq wait publish")
}

// blockKey records that an ordered delivery with a sequence was
// dead-lettered: its key waits for an operator (or for that sequence to come
// back) from now on.
func (c *Consumer) blockKey(it *item, reason string) {
	o := it.order
	if o == nil || o.Sequence == 0 || !it.ev.scoped {
		return
	}
	ctx, cancel := c.storeCtx(context.WithoutCancel(it.ctx))
	defer cancel()
	scope := ordering.Scope{Consumer: c.cfg.Name, Tenant: it.claim.Tenant, Key: o.Key}
	if err := ordering.Block(ctx, c.store.Pool(), c.store.Config().Schema, scope, o.Sequence, reason); err != nil {
		c.log.Warn("could not mark the ordering key blocked; its later messages wait for the gap anyway",
			"key_hash", it.ev.KeyHash, "err", redact.Error(err))
	}
}

// orderGate schedules one session's ordered deliveries: one at a time per
// ordering key, in the order they arrived; a delivery found early waits
// here (unacknowledged) until its predecessor is applied, and a key whose
// delivery went to a retry tier waits for that delivery to come back. It
// sits between the client library and the pipeline.
type orderGate struct {
	out     chan<- amqp.Delivery
	stop    <-chan struct{}
	budget  *byteBudget
	keyOf   func(*amqp.Delivery) string
	timeout time.Duration
	max     int
	log     *slog.Logger

	// sendMu orders sends to out before its close.
	sendMu sync.RWMutex
	closed bool

	mu       sync.Mutex
	keys     map[string]*gateKey
	waiting  int
	expiring map[uint64]bool
}

// gateKey is one ordering key's place in the gate.
type gateKey struct {
	// busy: one of its deliveries is in the pipeline.
	busy bool
	// queue: arrived, waiting for their turn.
	queue []amqp.Delivery
	// early: found early in the transaction, waiting for their predecessor.
	early []waitingDelivery
	// await is the idempotency key of its delivery in a retry tier, which
	// comes back before any other of the key runs ("" none).
	await      string
	awaitSince time.Time
}

type waitingDelivery struct {
	d     amqp.Delivery
	seq   int64
	since time.Time
}

func newOrderGate(c *Consumer, s *session, out chan<- amqp.Delivery) *orderGate {
	return &orderGate{
		out: out, stop: s.stop, budget: s.budget, timeout: c.cfg.Ordering.GapTimeout, max: c.cfg.Ordering.MaxWaiting, log: c.log,
		keyOf: func(d *amqp.Delivery) string {
			k, _ := c.keyOf(d)
			return k
		},
		keys: map[string]*gateKey{}, expiring: map[uint64]bool{},
	}
}

// send hands d to the pipeline; the buffer is as deep as the prefetch, so
// it never waits long. Once the buffer is closed (the session ends), d is
// dropped: it is never acked, and the broker delivers it again.
func (g *orderGate) send(d amqp.Delivery) {
	g.sendMu.RLock()
	defer g.sendMu.RUnlock()
	if g.closed {
		return
	}
	select {
	case g.out <- d:
	case <-g.stop:
	}
}

// close closes the pipeline's buffer (the client library's deliveries
// ended) once no send is under way.
func (g *orderGate) close() {
	g.sendMu.Lock()
	defer g.sendMu.Unlock()
	g.closed = true
	close(g.out)
}

// admit takes a delivery from the client library: to the pipeline now, or
// behind its key's.
func (g *orderGate) admit(d amqp.Delivery) {
	o, err := wire.ReadOrdering(d.Headers)
	if err != nil || o.Key == "" {
		g.send(d) // unordered; invalid headers are the pipeline's to refuse
		return
	}
	g.mu.Lock()
	k := g.keys[o.Key]
	if k == nil {
		k = &gateKey{}
		g.keys[o.Key] = k
	}
	switch {
	case !k.busy && k.await != "" && g.keyOf(&d) == k.await:
		// The retried delivery its key waits for is back: it goes first.
		k.await, k.busy = "", true
	case k.busy || k.await != "" || len(k.queue) > 0:
		k.queue = append(k.queue, d)
		g.mu.Unlock()
		return
	default:
		k.busy = true
	}
	g.mu.Unlock()
	g.send(d)
}

// done learns how a delivery of the pipeline ended and lets its key's next
// one go.
func (g *orderGate) done(it *item, outcome Outcome) {
	o := it.order
	if o == nil || o.Key == "" {
		return
	}
	g.mu.Lock()
	k := g.keys[o.Key]
	if k == nil || !k.busy {
		if outcome == OutcomeWaiting && !o.circled {
			g.waiting-- // its place (reserve) is not used
		}
		g.mu.Unlock()
		return
	}
	k.busy = false
	var next *amqp.Delivery
	switch outcome {
	case OutcomeWaiting:
		if !o.circled {
			// In the place reserve took for it.
			k.early = append(k.early, waitingDelivery{d: *it.d, seq: o.Sequence, since: o.since(it.start)})
		}
	case OutcomeRetried, OutcomeLeaseLost, OutcomeInProgress, OutcomeCopyFailed:
		// It comes back (a retry tier, a requeue): without a sequence, its
		// key's later deliveries wait for it. With one, they go on: each
		// one's sequence says whether it runs, and an early one waits in
		// the waiting room, which is bounded, rather than in the key's
		// queue, which is not.
		if key := it.claim.Key; key != "" && o.Sequence == 0 {
			k.await, k.awaitSince = key, time.Now()
		}
	case OutcomeProcessed, OutcomeRejected:
		if o.Sequence > 0 && !o.applied {
			for i, w := range k.early {
				if w.seq == o.Sequence+1 {
					k.early = append(k.early[:i], k.early[i+1:]...)
					g.waiting--
					g.budget.force(int64(len(w.d.Body)))
					next = &w.d
					break
				}
			}
		}
	}
	if next == nil && k.await == "" && len(k.queue) > 0 {
		next = &k.queue[0]
		k.queue = k.queue[1:]
	}
	if next != nil {
		k.busy = true
	} else if k.await == "" && len(k.early) == 0 {
		delete(g.keys, o.Key)
	}
	g.mu.Unlock()
	if next != nil {
		g.send(*next)
	}
}

// reserve takes a place in the waiting room for a delivery found early, and
// reports whether there was one: a delivery that gets none waits in a retry
// tier. The place is taken at once, not when done keeps the delivery, so
// that deliveries found early together (one per handler) cannot overfill
// the room.
func (g *orderGate) reserve() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.waiting >= g.max {
		return false
	}
	g.waiting++
	return true
}

// takeExpired reports whether the delivery tag was let go after waiting
// its GapTimeout (and forgets it).
func (g *orderGate) takeExpired(tag uint64) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.expiring[tag] {
		return false
	}
	delete(g.expiring, tag)
	return true
}

// expire lets go what waited past the GapTimeout: an early delivery runs
// once more, and goes to the DLQ if it is still early; a key that waited
// for a retried delivery goes on without it.
func (g *orderGate) expire(now time.Time) {
	var send []amqp.Delivery
	g.mu.Lock()
	for name, k := range g.keys {
		if k.await != "" && now.Sub(k.awaitSince) >= g.timeout {
			g.log.Warn("a retried message of an ordering key did not come back within the gap timeout; its key goes on without it",
				"gap_timeout", g.timeout)
			k.await = ""
		}
		kept := k.early[:0]
		for _, w := range k.early {
			if now.Sub(w.since) < g.timeout {
				kept = append(kept, w)
				continue
			}
			g.waiting--
			g.expiring[w.d.DeliveryTag] = true
			g.budget.force(int64(len(w.d.Body)))
			k.queue = append([]amqp.Delivery{w.d}, k.queue...)
		}
		k.early = kept
		if !k.busy && k.await == "" && len(k.queue) > 0 {
			k.busy = true
			send = append(send, k.queue[0])
			k.queue = k.queue[1:]
		} else if !k.busy && k.await == "" && len(k.early) == 0 && len(k.queue) == 0 {
			delete(g.keys, name)
		}
	}
	g.mu.Unlock()
	for _, d := range send {
		g.send(d)
	}
}

// run expires waiting deliveries until the session stops.
func (g *orderGate) run() {
	t := time.NewTicker(min(max(g.timeout/10, 10*time.Millisecond), time.Second))
	defer t.Stop()
	for {
		select {
		case now := <-t.C:
			g.expire(now)
		case <-g.stop:
			return
		}
	}
}
