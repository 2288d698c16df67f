package consumer

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// headerPublishID tags each copy so that a basic.return can be matched to it.
const headerPublishID = "x-idemq-publish-id"

// ErrUnroutable means the broker returned a mandatory publish: no queue was
// bound to take it.
var ErrUnroutable = errors.New("unroutable: returned by the broker")

// publisher publishes on one confirm-mode channel and waits for each
// confirm. It is safe for concurrent use. A returned (unroutable) message is
// a failure, never a silent drop: RabbitMQ sends basic.return before the
// basic.ack of the same message, and the returns are moved into a set under
// the same lock the waiter checks, so no return slips between the two.
type publisher struct {
	ch      *amqp.Channel
	timeout time.Duration
	seq     atomic.Uint64
	prefix  string

	mu       sync.Mutex
	returns  chan amqp.Return
	returned map[string]time.Time
	done     chan struct{}
}

func newPublisher(ch *amqp.Channel, timeout time.Duration, prefix string) (*publisher, error) {
	if err := ch.Confirm(false); err != nil {
		return nil, fmt.Errorf("confirm mode: %w", err)
	}
	p := &publisher{
		ch:       ch,
		timeout:  timeout,
		prefix:   prefix,
		returns:  ch.NotifyReturn(make(chan amqp.Return, 256)),
		returned: map[string]time.Time{},
		done:     make(chan struct{}),
	}
	go p.drainLoop()
	return p, nil
}

// drainLoop keeps the returns channel read, so that the library never blocks on it.
func (p *publisher) drainLoop() {
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-p.done:
			return
		case r, ok := <-p.returns:
			if !ok {
				return
			}
			p.mu.Lock()
			p.record(r)
			p.drainLocked()
			p.mu.Unlock()
		case now := <-t.C:
			p.mu.Lock()
			for id, at := range p.returned {
				if now.Sub(at) > time.Minute {
					delete(p.returned, id)
				}
			}
			p.mu.Unlock()
		}
	}
}

func (p *publisher) record(r amqp.Return) {
	if id, ok := headerString(r.Headers, headerPublishID); ok {
		p.returned[id] = time.Now()
	}
}

func (p *publisher) drainLocked() {
	for {
		select {
		case r, ok := <-p.returns:
			if !ok {
				return
			}
			p.record(r)
		default:
			return
		}
	}
}

func (p *publisher) close() { close(p.done) }

// publish sends msg (mandatory, persistent) and returns once the broker has
// confirmed it: nil means the copy is durable in a queue.
func (p *publisher) publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	ctx, cancel := context.WithTimeout(ctx, p.timeout)
	defer cancel()
	id := p.prefix + strconv.FormatUint(p.seq.Add(1), 36)
	if msg.Headers == nil {
		msg.Headers = amqp.Table{}
	}
	msg.Headers[headerPublishID] = id
	defer delete(msg.Headers, headerPublishID)
	msg.DeliveryMode = amqp.Persistent
	conf, err := p.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, msg)
	if err != nil {
		return fmt.Errorf("publish to %q/%q: %w", exchange, key, err)
	}
	acked, err := conf.WaitContext(ctx)
	if err != nil {
		return fmt.Errorf("publish to %q/%q: wait for confirm: %w", exchange, key, err)
	}
	if !acked {
		return fmt.Errorf("publish to %q/%q: nacked by the broker", exchange, key)
	}
	p.mu.Lock()
	p.drainLocked()
	_, wasReturned := p.returned[id]
	delete(p.returned, id)
	p.mu.Unlock()
	if wasReturned {
		return fmt.Errorf("publish to %q/%q: %w", exchange, key, ErrUnroutable)
	}
	return nil
}
