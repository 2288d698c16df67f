package chaos

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/amqpdial"
)

// confirmWindow is how many messages may await their confirm at once.
const confirmWindow = 256

// publisher publishes the plan straight to the broker (not through
// toxiproxy: the faults are for the workers) with publisher confirms. The
// broker faults hit it too: it dials again and publishes again whatever was
// not confirmed, so a message may be published more than once, as a real
// publisher's retry would.
type publisher struct {
	addrs amqpdial.Addrs
	// exchange and routingKey are where the messages go: the work queue
	// through the default exchange, or a partitioned queue's Q.order.
	exchange, routingKey string
	plan                 *plan
	rate                 float64

	conn *amqp.Connection
	ch   *amqp.Channel
	// confirmed counts confirmed messages; republished those sent again
	// after a failure; reconnects the connections made after the first.
	confirmed, republished, reconnects, returned atomic.Int64
	finished                                     atomic.Bool
}

func newPublisher(addrs amqpdial.Addrs, exchange, routingKey string, p *plan, rate float64) *publisher {
	return &publisher{addrs: addrs, exchange: exchange, routingKey: routingKey, plan: p, rate: rate}
}

// message is the publishing of one copy of op o.
func (o op) message() amqp.Publishing {
	h := amqp.Table{}
	if o.Tenant != "" {
		h["x-tenant-id"] = o.Tenant
	}
	msg := amqp.Publishing{Headers: h, Body: o.Body, DeliveryMode: amqp.Persistent, ContentType: "application/json", Timestamp: time.Now()}
	if o.InHeader {
		h["Idempotency-Key"] = o.Key
	} else {
		msg.MessageId = o.Key
	}
	if o.TraceState > 0 {
		// Optional headers a copy may drop to fit frame_max (no worker
		// propagates trace context, so they travel as published).
		h["traceparent"] = fmt.Sprintf("00-%032x-%016x-01", o.Index+1, o.Index+1)
		h["tracestate"] = "chaos=" + strings.Repeat("t", o.TraceState-len("chaos="))
	}
	if o.HeaderPad > 0 {
		h["x-chaos-pad"] = strings.Repeat("p", o.HeaderPad)
	}
	if o.OrderingKey != "" {
		h[consumer.HeaderOrderingKey] = o.OrderingKey
		h[consumer.HeaderSequence] = int64(o.Sequence)
	}
	return msg
}

// run publishes every publication of the plan, in order, bursts from
// burstSize goroutines at once, and returns once all are confirmed.
func (p *publisher) run(ctx context.Context) error {
	defer func() {
		if p.conn != nil {
			_ = p.conn.Close()
		}
	}()
	start := time.Now()
	sent := 0
	var window []op
	for _, pub := range p.plan.Pubs {
		o := p.plan.Ops[pub.Op]
		if p.rate > 0 {
			// Spacing the publications out is pacing, not synchronisation.
			if wait := time.Until(start.Add(time.Duration(float64(sent) / p.rate * float64(time.Second)))); wait > 0 {
				select {
				case <-ctx.Done():
					return ctx.Err()
				case <-time.After(wait):
				}
			}
		}
		sent += pub.Copies
		if pub.Copies > 1 {
			if err := p.confirmAll(ctx, window); err != nil {
				return err
			}
			window = window[:0]
			if err := p.burst(ctx, o, pub.Copies); err != nil {
				return err
			}
			continue
		}
		window = append(window, o)
		if len(window) >= confirmWindow {
			if err := p.confirmAll(ctx, window); err != nil {
				return err
			}
			window = window[:0]
		}
	}
	if err := p.confirmAll(ctx, window); err != nil {
		return err
	}
	p.finished.Store(true)
	return nil
}

// confirmAll publishes ops and waits for all their confirms; after a
// failure it dials again and publishes them all again, until ctx ends.
func (p *publisher) confirmAll(ctx context.Context, ops []op) error {
	for attempt := 0; ; attempt++ {
		if len(ops) == 0 {
			return nil
		}
		err := p.tryBatch(ctx, ops, attempt > 0)
		if err == nil {
			p.confirmed.Add(int64(len(ops)))
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("publish: %w (last error: %v)", ctx.Err(), err)
		}
		p.reset()
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(min(attempt+1, 10)) * 200 * time.Millisecond):
		}
	}
}

func (p *publisher) tryBatch(ctx context.Context, ops []op, again bool) error {
	ch, err := p.channel()
	if err != nil {
		return err
	}
	if again {
		p.republished.Add(int64(len(ops)))
	}
	confs := make([]*amqp.DeferredConfirmation, 0, len(ops))
	for _, o := range ops {
		c, err := ch.PublishWithDeferredConfirmWithContext(ctx, p.exchange, p.routingKey, true, false, o.message())
		if err != nil {
			return err
		}
		confs = append(confs, c)
	}
	return waitConfirms(ctx, confs)
}

// burst publishes copies of o from as many goroutines, released together,
// and publishes them all again if any is not confirmed.
func (p *publisher) burst(ctx context.Context, o op, copies int) error {
	for attempt := 0; ; attempt++ {
		err := p.tryBurst(ctx, o, copies, attempt > 0)
		if err == nil {
			p.confirmed.Add(int64(copies))
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("publish burst: %w (last error: %v)", ctx.Err(), err)
		}
		p.reset()
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(min(attempt+1, 10)) * 200 * time.Millisecond):
		}
	}
}

func (p *publisher) tryBurst(ctx context.Context, o op, copies int, again bool) error {
	ch, err := p.channel()
	if err != nil {
		return err
	}
	if again {
		p.republished.Add(int64(copies))
	}
	confs := make([]*amqp.DeferredConfirmation, copies)
	errs := make([]error, copies)
	release := make(chan struct{})
	var wg sync.WaitGroup
	for i := range copies {
		wg.Go(func() {
			<-release
			confs[i], errs[i] = ch.PublishWithDeferredConfirmWithContext(ctx, p.exchange, p.routingKey, true, false, o.message())
		})
	}
	close(release)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	return waitConfirms(ctx, confs)
}

func waitConfirms(ctx context.Context, confs []*amqp.DeferredConfirmation) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for _, c := range confs {
		ok, err := c.WaitContext(ctx)
		if err != nil {
			return fmt.Errorf("wait for confirm: %w", err)
		}
		if !ok {
			return errors.New("publish nacked, or the channel closed before the confirm")
		}
	}
	return nil
}

func (p *publisher) channel() (*amqp.Channel, error) {
	if p.ch != nil && !p.ch.IsClosed() {
		return p.ch, nil
	}
	p.reset()
	d := amqpdial.Dialer{Addrs: p.addrs, Name: "idemq-chaos-publisher", Config: &amqp.Config{Heartbeat: 5 * time.Second}, Timeout: 5 * time.Second}
	conn, err := d.Dial(context.Background())
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Confirm(false)
	}
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	// A return (unroutable: the queue is missing) would be a message never
	// delivered: counted, and the soak fails on it.
	returns := ch.NotifyReturn(make(chan amqp.Return, 16))
	go func() {
		for range returns {
			p.returned.Add(1)
		}
	}()
	p.conn, p.ch = conn, ch
	return ch, nil
}

func (p *publisher) reset() {
	if p.conn != nil {
		_ = p.conn.Close()
	}
	if p.ch != nil || p.conn != nil {
		p.reconnects.Add(1)
	}
	p.conn, p.ch = nil, nil
}
