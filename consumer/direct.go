package consumer

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/trace"

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

// processDirect takes d through c's pipeline on a recording session; at
// (if any) may crash it at a stage (see crashAt).
func processDirect(ctx context.Context, cons any, d amqp.Delivery, at kit.Hook) (kit.Run, error) {
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
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if at != nil {
		c.direct = &directRun{at: at, cancel: cancel}
	}
	it := c.begin(ctx, &d)
	// The attempt runs on a goroutine of its own, which a crash ends
	// (runtime.Goexit) wherever it is.
	finished := make(chan bool)
	go func() {
		ok := false
		defer func() { finished <- ok }()
		c.processItems(ctx, s, []*item{it})
		ok = true
	}()
	ok = <-finished
	rec.mu.Lock()
	defer rec.mu.Unlock()
	run := kit.Run{Claim: it.claim, Published: rec.published, Acked: rec.acked, Requeued: rec.requeued}
	if !ok {
		if c.direct == nil || c.direct.stage == 0 {
			return run, errors.New("consumer kit: the attempt's goroutine exited without a crash")
		}
		run.Crashed, run.Stage, run.TraceID = true, c.direct.stage, c.direct.traceID
	}
	return run, nil
}

// directRun is the crash hook of a consumer the test kit runs, and where
// the attempt crashed.
type directRun struct {
	at     kit.Hook
	cancel context.CancelFunc
	// stage and traceID are set by the crash, read once the attempt's
	// goroutine has exited.
	stage   kit.Stage
	traceID string
}

// crashAt calls the test kit's hook at stage (a no-op for a consumer that
// is not run by the kit). When the hook asks for a crash, the attempt dies
// here as its process would: the transactions in txs (those it holds open)
// are abandoned, their connections closed under them without COMMIT or
// ROLLBACK, so that Postgres rolls them back; the attempt's context ends,
// which stops the heartbeat; and the goroutine exits, running only its
// deferred calls, so nothing is released, published or acked: the lease
// expires and the broker redelivers.
func (c *Consumer) crashAt(ctx context.Context, stage kit.Stage, step string, txs ...pgx.Tx) {
	r := c.direct
	if r == nil || r.at == nil || !r.at(ctx, stage, step) {
		return
	}
	for _, tx := range txs {
		if tx != nil {
			_ = tx.Conn().PgConn().Conn().Close()
		}
	}
	r.stage = stage
	if sc := trace.SpanContextFromContext(ctx); sc.HasTraceID() {
		r.traceID = sc.TraceID().String()
	}
	r.cancel()
	runtime.Goexit()
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
