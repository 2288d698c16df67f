package consumertest

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/internal/kit"
	"github.com/idemq/idemq/dedup"
)

// Defaults of the configuration a Runner completes: a consumer needs a
// queue, a name and a broker URL, and a Runner never connects.
const (
	DefaultQueue = "consumertest"
	DefaultName  = "consumertest"
	// placeholderURL fills Config.URL, which is required and never dialled.
	placeholderURL = "amqp://consumertest.invalid/"
)

// RunHandler runs h on one delivery of msg, as a consumer with the default
// configuration (Name DefaultName) that declares Steps (so h may run
// steps) would, and returns what happened; see Runner.Run.
func RunHandler(tb testing.TB, store *dedup.Store, h consumer.Handler, msg amqp.Publishing) *Result {
	tb.Helper()
	return NewRunner(store, h, &consumer.Config{Steps: true}).Run(tb, msg)
}

// Runner runs a handler the way a consumer configured by its Config runs
// it, one delivery at a time, without a broker. It is safe for concurrent
// use.
type Runner struct {
	store   *dedup.Store
	handler consumer.Handler
	cfg     consumer.Config
}

// NewRunner returns a runner of h over store. cfg (nil for defaults) is the
// consumer's configuration: Name scopes the keys (default DefaultName);
// HandlerTimeout, MaxAttempts, the key, tenant and fingerprint settings,
// HeaderKeys, NoReply and OnOutcome apply as in a consumer; Queue defaults
// to DefaultQueue and URL is never dialled; each Run is one delivery, a
// group of one. A nil Logger logs to the test's log.
func NewRunner(store *dedup.Store, h consumer.Handler, cfg *consumer.Config) *Runner {
	var c consumer.Config
	if cfg != nil {
		c = *cfg
	}
	c.Queue = cmp.Or(c.Queue, DefaultQueue)
	c.Name = cmp.Or(c.Name, DefaultName)
	c.URL = cmp.Or(c.URL, placeholderURL)
	c.Group.Size = 1
	return &Runner{store: store, handler: h, cfg: c}
}

// Result is what happened to one delivery.
type Result struct {
	// Event is what the runtime reported for the delivery (to
	// Config.OnOutcome): its Outcome, the dead-letter Reason, the failure
	// behind a retry or a dead letter (Err), its Attempt.
	consumer.Event
	// Called reports whether the handler ran: not for a duplicate, a key
	// held by another worker, a reused or an invalid key.
	Called bool
	// Rejection is the business rejection the handler returned, for
	// OutcomeRejected.
	Rejection *consumer.RejectError
	// Response is the result stored with the key, for OutcomeProcessed and
	// OutcomeRejected; for OutcomeDuplicate, the stored result the duplicate
	// got back.
	Response consumer.Response
	// Record is the key's row after the run (nil when the delivery had no
	// valid key): its state, attempts, recovery point and stored result.
	Record *dedup.Record
	// Copy is the message published in place of the delivery: the retry
	// copy (to a retry tier of the queue) or the dead letter (to the
	// queue's dead-letter exchange). Nil when the delivery was acked as
	// handled. Run(tb, Copy.Publishing) delivers a retry copy again, as its
	// tier would: with the next attempt number.
	Copy *Publication
	// Reply is the stored result sent to the message's reply_to, if any.
	Reply *Publication
	// Acked reports that the delivery was acknowledged (after its commit, or
	// after its copy was confirmed); Requeued, that it went back to its
	// queue unacknowledged instead.
	Acked, Requeued bool
}

// Publication is a message the runtime published while settling a
// delivery.
type Publication struct {
	Exchange, RoutingKey string
	amqp.Publishing
}

// Run delivers msg once, as the broker would deliver it from the work
// queue (exchange "", routing key the queue), and takes it through the
// consumer runtime's own pipeline: the key claimed in the store with a real
// lease (and the lease's heartbeat), the handler run in a real transaction
// under HandlerTimeout, with the claim in its context (outbox.Enqueue
// derives message ids from it; Step and DerivedKey work), a panic recovered
// as an infrastructure failure, the key completed in the same transaction,
// the commit, then the outcome routed. Instead of publishing, the retry or
// dead-letter copy and the reply are recorded in the Result, and the broker
// confirms them at once.
//
// The key comes from msg as the consumer reads it (by default its
// MessageId) and the tenant from the tenant header. Running the same
// message again is a redelivery: a duplicate once the key completed (the
// handler does not run), a takeover after a retried run (the handler runs
// again, and steps committed by the earlier run are skipped).
//
// Run fails the test only when it cannot run (an invalid configuration, a
// schema that is not migrated); whatever the handler does is in the Result.
func (r *Runner) Run(tb testing.TB, msg amqp.Publishing) *Result {
	tb.Helper()
	res, err := r.run(tb, msg)
	if err != nil {
		tb.Fatalf("consumertest: %v", err)
	}
	return res
}

// run delivers msg once; its error says why it could not run.
func (r *Runner) run(tb testing.TB, msg amqp.Publishing) (*Result, error) {
	ctx := context.Background()
	var (
		called    atomic.Bool
		mu        sync.Mutex
		rejection *consumer.RejectError
		event     consumer.Event
	)
	h := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		called.Store(true)
		resp, err := r.handler(ctx, tx, d)
		if rej := (*consumer.RejectError)(nil); errors.As(err, &rej) {
			mu.Lock()
			rejection = rej
			mu.Unlock()
		}
		return resp, err
	}
	cfg := r.cfg
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(testWriter{tb}, nil))
	}
	onOutcome := cfg.OnOutcome
	cfg.OnOutcome = func(e consumer.Event) {
		mu.Lock()
		event = e
		mu.Unlock()
		if onOutcome != nil {
			onOutcome(e)
		}
	}
	c, err := consumer.New(r.store, h, &cfg)
	if err != nil {
		return nil, err
	}
	run, err := kit.Process(ctx, c, delivery(msg, cfg.Queue))
	if err != nil {
		return nil, err
	}
	mu.Lock()
	defer mu.Unlock()
	res := &Result{Event: event, Called: called.Load(), Rejection: rejection, Acked: run.Acked, Requeued: run.Requeued}
	for _, p := range run.Published {
		pub := &Publication{Exchange: p.Exchange, RoutingKey: p.RoutingKey, Publishing: p.Msg}
		if p.Exchange == "" && p.RoutingKey == msg.ReplyTo {
			res.Reply = pub
		} else {
			res.Copy = pub
		}
	}
	if cl := run.Claim; cl.Key != "" {
		rec, err := r.store.Inspect(ctx, cl.Scope)
		switch {
		case errors.Is(err, dedup.ErrNotFound):
		case err != nil:
			return nil, fmt.Errorf("inspect the key: %w", err)
		default:
			res.Record = rec
		}
	}
	switch res.Outcome {
	case consumer.OutcomeProcessed, consumer.OutcomeRejected, consumer.OutcomeDuplicate:
		if res.Record != nil && res.Record.Result != nil {
			res.Response = consumer.Response{Code: res.Record.Result.Code, Body: res.Record.Result.Response}
		}
	}
	return res, nil
}

// delivery is msg as the broker delivers it from queue, after a publish to
// the default exchange.
func delivery(msg amqp.Publishing, queue string) amqp.Delivery {
	return amqp.Delivery{
		Headers:         maps.Clone(msg.Headers),
		ContentType:     msg.ContentType,
		ContentEncoding: msg.ContentEncoding,
		DeliveryMode:    msg.DeliveryMode,
		Priority:        msg.Priority,
		CorrelationId:   msg.CorrelationId,
		ReplyTo:         msg.ReplyTo,
		Expiration:      msg.Expiration,
		MessageId:       msg.MessageId,
		Timestamp:       msg.Timestamp,
		Type:            msg.Type,
		UserId:          msg.UserId,
		AppId:           msg.AppId,
		DeliveryTag:     1,
		RoutingKey:      queue,
		Body:            msg.Body,
	}
}

// testWriter writes a consumer's log lines to the test's log.
type testWriter struct{ tb testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.tb.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}
