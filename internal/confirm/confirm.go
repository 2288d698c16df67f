// Package confirm is idemq's one publisher with confirms. Everything idemq
// publishes in place of something it will then acknowledge or mark (a retry
// or dead-letter copy, a reply, a replayed dead letter, an outbox row) goes
// through a Publisher, so the rule "acknowledged only after what replaces it
// is durable" is decided in one place.
//
// # What a nil result means
//
// A publish succeeds only when the broker acked it AND did not return it.
// Every publish is mandatory: a message that no queue takes comes back as a
// basic.return, and RabbitMQ sends that return before the basic.ack of the
// same message. amqp091-go hands both to listeners from the one goroutine
// that reads the connection, in that order, so the Publisher reads both in
// one goroutine of its own and, whenever it takes a confirm, first drains
// every return already delivered. A publish's result is therefore decided
// only after its return (if any) and its confirm are both in.
//
// # Matching returns to publishes
//
// A basic.return carries no delivery tag. The Publisher matches it to the
// unconfirmed publishes by content (exchange, routing key, message id,
// correlation id, body), so nothing is added to the message. When several
// unconfirmed publishes match one return, all of them fail with
// ErrUnroutable: a routable twin then counts as failed and its original is
// retried (a duplicate that the key absorbs) rather than a returned one
// counting as durable (a loss).
package confirm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Errors a publish can end with. Test them with errors.Is.
var (
	// ErrUnroutable: the broker returned the message (mandatory publish, no
	// queue took it).
	ErrUnroutable = errors.New("the broker returned the message as unroutable")
	// ErrNacked: the broker refused the message (basic.nack).
	ErrNacked = errors.New("the broker nacked the message")
	// ErrClosed: the channel closed before the broker confirmed the message;
	// its fate is unknown.
	ErrClosed = errors.New("the channel closed before the broker confirmed the message")
	// ErrTooLarge: the message's properties do not fit in one frame of the
	// negotiated frame_max; sending it would make the broker close the
	// connection. It was not sent.
	ErrTooLarge = errors.New("the message's properties do not fit the negotiated frame_max")
)

// listenerBuffer is the depth of the return and confirm channels handed to
// amqp091-go. They are always read; amqp091-go drops a notification that
// waits longer than 5s, so they must never stay full.
const listenerBuffer = 1024

// Publisher publishes on one channel in confirm mode. It is safe for
// concurrent use. It owns the channel's confirm and return notifications:
// nothing else may publish on that channel or listen to them.
type Publisher struct {
	ch       *amqp.Channel
	frameMax int

	// sendMu orders the choice of a delivery tag with the publish that
	// takes it.
	sendMu sync.Mutex

	mu       sync.Mutex
	inFlight map[uint64]*Pending // by delivery tag
	closed   error               // set once the channel's confirms end

	done chan struct{} // closed when the loop ends
}

// New puts ch in confirm mode and starts reading its confirms and returns.
// frameMax is the connection's negotiated frame size
// (amqp.Connection.Config.FrameSize); 0 means no limit.
func New(ch *amqp.Channel, frameMax int) (*Publisher, error) {
	if err := ch.Confirm(false); err != nil {
		return nil, fmt.Errorf("confirm mode: %w", err)
	}
	p := &Publisher{
		ch:       ch,
		frameMax: frameMax,
		inFlight: map[uint64]*Pending{},
		done:     make(chan struct{}),
	}
	returns := ch.NotifyReturn(make(chan amqp.Return, listenerBuffer))
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, listenerBuffer))
	go p.loop(returns, confirms)
	return p, nil
}

// Pending is one published message whose confirm may not be in yet.
type Pending struct {
	tag                  uint64
	exchange, routingKey string
	messageID, corrID    string
	body                 []byte

	returned *amqp.Return // set by the loop before done closes
	err      error
	done     chan struct{}
}

// Done is closed once the message's result is known.
func (p *Pending) Done() <-chan struct{} { return p.done }

// Err is the message's result once Done is closed: nil means the broker
// confirmed it and did not return it, so it is durable in a queue;
// otherwise a *ReturnError (ErrUnroutable), ErrNacked or ErrClosed.
func (p *Pending) Err() error {
	select {
	case <-p.done:
		return p.err
	default:
		return errors.New("publisher confirm still pending")
	}
}

// Wait blocks until the result is known or ctx ends.
func (p *Pending) Wait(ctx context.Context) error {
	select {
	case <-p.done:
		return p.err
	case <-ctx.Done():
		return fmt.Errorf("wait for publisher confirm: %w", context.Cause(ctx))
	}
}

// Publish sends msg as a mandatory publish and returns at once; the
// Pending tells the result. An error means the message was not sent.
func (p *Publisher) Publish(ctx context.Context, exchange, routingKey string, msg amqp.Publishing) (*Pending, error) {
	if err := FitsFrame(msg, p.frameMax); err != nil {
		return nil, err
	}
	pd := &Pending{
		exchange: exchange, routingKey: routingKey,
		messageID: msg.MessageId, corrID: msg.CorrelationId, body: msg.Body,
		done: make(chan struct{}),
	}
	p.sendMu.Lock()
	defer p.sendMu.Unlock()
	p.mu.Lock()
	if p.closed != nil {
		err := p.closed
		p.mu.Unlock()
		return nil, err
	}
	// Registered before it is sent: its confirm cannot come earlier.
	pd.tag = p.ch.GetNextPublishSeqNo()
	p.inFlight[pd.tag] = pd
	p.mu.Unlock()
	if err := p.ch.PublishWithContext(ctx, exchange, routingKey, true, false, msg); err != nil {
		p.mu.Lock()
		delete(p.inFlight, pd.tag)
		p.mu.Unlock()
		return nil, fmt.Errorf("publish: %w", err)
	}
	return pd, nil
}

// PublishWait publishes msg and waits for its result; nil means durable.
func (p *Publisher) PublishWait(ctx context.Context, exchange, routingKey string, msg amqp.Publishing) error {
	pd, err := p.Publish(ctx, exchange, routingKey, msg)
	if err != nil {
		return err
	}
	return pd.Wait(ctx)
}

// FrameMax is the frame size the publisher checks messages against (0: no
// limit).
func (p *Publisher) FrameMax() int { return p.frameMax }

// Closed is closed once the channel has closed and every pending publish
// has failed with ErrClosed.
func (p *Publisher) Closed() <-chan struct{} { return p.done }

// loop is the one reader of the channel's returns and confirms.
func (p *Publisher) loop(returns <-chan amqp.Return, confirms <-chan amqp.Confirmation) {
	defer close(p.done)
	for {
		select {
		case r, ok := <-returns:
			if !ok {
				returns = nil
				continue
			}
			p.onReturn(&r)
		case c, ok := <-confirms:
			if !ok {
				p.closeAll()
				return
			}
			// The return of this message, if any, was handed over before its
			// confirm: take every return already waiting first.
			returns = p.drain(returns)
			p.onConfirm(c)
		}
	}
}

// drain takes every return already waiting, without blocking.
func (p *Publisher) drain(returns <-chan amqp.Return) <-chan amqp.Return {
	for returns != nil {
		select {
		case r, ok := <-returns:
			if !ok {
				return nil
			}
			p.onReturn(&r)
		default:
			return returns
		}
	}
	return nil
}

// onReturn marks every unconfirmed publish the return may belong to.
func (p *Publisher) onReturn(r *amqp.Return) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, pd := range p.inFlight {
		if pd.matches(r) {
			pd.returned = r
		}
	}
}

func (pd *Pending) matches(r *amqp.Return) bool {
	return pd.exchange == r.Exchange && pd.routingKey == r.RoutingKey &&
		pd.messageID == r.MessageId && pd.corrID == r.CorrelationId &&
		bytes.Equal(pd.body, r.Body)
}

func (p *Publisher) onConfirm(c amqp.Confirmation) {
	p.mu.Lock()
	pd, ok := p.inFlight[c.DeliveryTag]
	delete(p.inFlight, c.DeliveryTag)
	p.mu.Unlock()
	if !ok {
		return
	}
	switch {
	case !c.Ack:
		pd.err = ErrNacked
	case pd.returned != nil:
		pd.err = &ReturnError{Code: pd.returned.ReplyCode, Text: pd.returned.ReplyText}
	}
	pd.body = nil
	close(pd.done)
}

// closeAll fails every pending publish: the channel closed first.
func (p *Publisher) closeAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = ErrClosed
	for tag, pd := range p.inFlight {
		pd.err = ErrClosed
		close(pd.done)
		delete(p.inFlight, tag)
	}
}

// ReturnError is the result of a publish the broker returned. It matches
// ErrUnroutable.
type ReturnError struct {
	Code uint16 // reply code, e.g. 312
	Text string // reply text, e.g. NO_ROUTE
}

func (e *ReturnError) Error() string { return fmt.Sprintf("unroutable: %d %s", e.Code, e.Text) }

// Is makes errors.Is(err, ErrUnroutable) hold.
func (e *ReturnError) Is(target error) bool { return target == ErrUnroutable }
