package consumer

import (
	"context"
	"errors"
	"fmt"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer/internal/kit"
)

// The test kit (consumer/consumertest) runs handlers through this file: one
// delivery takes the pipeline a delivery from the broker takes (a group of
// one: the key reserved, the handler run under its timeout with the claim
// in its context and panics recovered, the key completed in the handler's
// transaction, the commit, the settlement), except that the session's
// publisher and acks are a recorder instead of a channel.

func init() { kit.Process = processDirect }

// directFrameMax is the frame_max the recorder reports: RabbitMQ's default,
// so that copies are trimmed as they would be on a default broker.
const directFrameMax = 128 << 10

// processDirect takes d through c's pipeline on a recording session.
func processDirect(ctx context.Context, cons any, d amqp.Delivery) (kit.Run, error) {
	c, ok := cons.(*Consumer)
	if !ok {
		return kit.Run{}, fmt.Errorf("consumer kit: %T is not a *consumer.Consumer", cons)
	}
	if c.keys == nil {
		keys, err := c.headerKeys(ctx)
		if err != nil {
			var fatal *fatalError
			if errors.As(err, &fatal) {
				err = fatal.err
			}
			return kit.Run{}, fmt.Errorf("header keys: %w", err)
		}
		c.keys = keys
	}
	rec := &recorder{}
	d.Acknowledger = rec
	s := &session{pub: rec, stop: make(chan struct{})}
	it := c.begin(ctx, &d)
	c.processItems(ctx, s, []*item{it})
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return kit.Run{Claim: it.claim, Published: rec.published, Acked: rec.acked, Requeued: rec.requeued}, nil
}

// recorder is a direct session's publisher, which confirms every message
// at once, and its deliveries' acknowledger.
type recorder struct {
	mu              sync.Mutex
	published       []kit.Publication
	acked, requeued bool
}

func (r *recorder) PublishWait(_ context.Context, exchange, routingKey string, msg amqp.Publishing) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.published = append(r.published, kit.Publication{Exchange: exchange, RoutingKey: routingKey, Msg: msg})
	return nil
}

func (r *recorder) FrameMax() int { return directFrameMax }

func (r *recorder) Ack(uint64, bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.acked = true
	return nil
}

func (r *recorder) Nack(_ uint64, _ bool, requeue bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.requeued = requeue
	return nil
}

func (r *recorder) Reject(_ uint64, requeue bool) error { return r.Nack(0, false, requeue) }
