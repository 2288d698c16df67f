// Package forward is the deduplicating stage behind `idemq forward`: a
// consumer of one work queue whose handler writes each message into the
// outbox, in the transaction that completes the message's key, and an outbox
// relay that publishes those rows to the target exchange with publisher
// confirms.
//
// # Guarantees
//
// Every unique key reaches the target exchange. With no crash it is
// published exactly once, whatever the duplicates: a duplicate finds its key
// completed and is acked without a second outbox row. A relay that dies
// between a broker confirm and its database commit publishes the row again
// after a restart (or another relay does), with the same message_id, so the
// next stage can deduplicate it. Missing, invalid and reused keys go to the
// work queue's DLQ with x-idemq-reason, as for any consumer.
//
// # What is forwarded
//
// The body, the content type, the message_id (the delivery's, or its key
// when it has none), correlation_id, reply_to and every header except those
// that describe the message's path through this stage rather than the
// message (wire.ForwardHeaders): idemq's own x-idemq-* headers (attempt counter, first-seen time,
// original exchange and routing key, dead-letter reasons), the broker's
// x-death, x-first-death-*, x-last-death-* and x-delivery-count, and the W3C
// traceparent/tracestate, which the relay replaces with its publish span
// (a child of this stage's processing span, so the trace continues). The
// routing key is the configured one, else the routing key the message was
// first published with (a retried message comes back from its retry tier
// with the work queue's name as routing key; the x-idemq-original-routing-key
// of idemq's signed copy remembers the first one). A publisher cannot steer
// it: the consumer trusts that header only on a copy whose signature
// verifies (consumer.Delivery.OriginalRoutingKey).
package forward

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/wire"
	"github.com/idemq/idemq/outbox"
)

// Defaults of a stage, where its Config leaves them zero.
const (
	// DefaultDrainTimeout bounds how long a stopping stage keeps its relay
	// running to publish the rows its last handlers committed.
	DefaultDrainTimeout = 10 * time.Second
	// DefaultGroupSize is the stage's group commit (its consumer's
	// Group.Size): the handler only queues an outbox row, so a group is cheap
	// whatever its size, and each group is one commit, one COPY of its rows
	// and one NOTIFY that wakes the relay. With relay batches of 500, groups
	// of 100 forwarded 1.3 to 1.8 times as many messages a second as the
	// consumer's default of 16 with the relay's batches of 100
	// (docs/benchmarks.md).
	DefaultGroupSize = 100
	// DefaultRelayBatchSize is the stage's relay batch (RelayConfig.BatchSize):
	// the relay takes the rows of several groups at once.
	DefaultRelayBatchSize = 500
)

// Config configures a Stage.
type Config struct {
	// Consumer configures the consumer of the work queue: URL, Queue and
	// Name are required. Its Logger is used by the whole stage. Its
	// GroupSize defaults to DefaultGroupSize, and its groups are always
	// optimistic (Group.Optimistic).
	Consumer consumer.Config
	// Exchange is where messages are forwarded ("" is the default exchange).
	Exchange string
	// RoutingKey, when set, replaces the routing key of every message.
	RoutingKey string
	// Relay configures the stage's outbox relay, which publishes the outbox
	// of the store's schema. Its BatchSize defaults to DefaultRelayBatchSize.
	Relay outbox.RelayConfig
	// DrainTimeout bounds the final flush of the outbox at shutdown.
	// Default DefaultDrainTimeout.
	DrainTimeout time.Duration
}

// Stage is a running forwarder: consumer plus relay.
type Stage struct {
	store    *dedup.Store
	outbox   *outbox.Outbox
	consumer *consumer.Consumer
	relay    *outbox.Relay
	cfg      Config
	log      *slog.Logger

	mu     sync.Mutex
	counts map[consumer.Outcome]int64
}

// New returns a stage that reads cfg.Consumer.Queue through store's keys and
// forwards to cfg.Exchange through the outbox of the store's schema.
func New(store *dedup.Store, cfg Config) (*Stage, error) {
	if store == nil {
		return nil, errors.New("forward: nil store")
	}
	cfg.DrainTimeout = cmp.Or(cfg.DrainTimeout, DefaultDrainTimeout)
	if cfg.Consumer.Logger == nil {
		cfg.Consumer.Logger = slog.Default()
	}
	ob, err := outbox.New(store.Pool(), &outbox.Config{Schema: store.Config().Schema})
	if err != nil {
		return nil, fmt.Errorf("forward: %w", err)
	}
	s := &Stage{store: store, outbox: ob, cfg: cfg, counts: map[consumer.Outcome]int64{}}
	s.log = cfg.Consumer.Logger.With("stage", "forward", "queue", cfg.Consumer.Queue, "consumer", cfg.Consumer.Name, "to_exchange", cfg.Exchange)

	ccfg := cfg.Consumer
	// The stage's handler writes only its outbox row, in the transaction:
	// exactly what optimistic groups are for (no savepoint per message; a
	// group that fails runs again isolated, and its rows count once).
	ccfg.Group.Optimistic = true
	ccfg.Group.Size = cmp.Or(ccfg.Group.Size, DefaultGroupSize)
	next := ccfg.OnOutcome
	ccfg.OnOutcome = func(ev consumer.Event) {
		s.mu.Lock()
		s.counts[ev.Outcome]++
		s.mu.Unlock()
		if next != nil {
			next(ev)
		}
	}
	h := Handler(ob, cfg.Exchange, cfg.RoutingKey)
	if ccfg.Ordering != nil {
		h = OrderedHandler(ob, cfg.Exchange, cfg.RoutingKey)
	}
	c, err := consumer.New(store, h, &ccfg)
	if err != nil {
		return nil, fmt.Errorf("forward: %w", err)
	}
	rcfg := cfg.Relay
	rcfg.BatchSize = cmp.Or(rcfg.BatchSize, DefaultRelayBatchSize)
	if rcfg.Logger == nil {
		rcfg.Logger = cfg.Consumer.Logger
	}
	r, err := outbox.NewRelay(ob, cfg.Consumer.URL, &rcfg)
	if err != nil {
		return nil, fmt.Errorf("forward: %w", err)
	}
	s.consumer, s.relay = c, r
	return s, nil
}

// Counts returns how many deliveries ended in each outcome so far.
func (s *Stage) Counts() map[consumer.Outcome]int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.counts)
}

// Ready reports whether the stage's consumer consumes (see
// consumer.Consumer.Ready).
func (s *Stage) Ready() error { return s.consumer.Ready() }

// Run forwards until ctx ends. Then the consumer stops taking deliveries and
// lets its in-flight handlers finish (consumer.Config.ShutdownTimeout), the
// relay keeps publishing until the outbox has no pending row or DrainTimeout
// passes (rows left behind are published by the next relay to run: none is
// lost), and Run returns nil. It returns an error when the consumer cannot
// start (for example, a queue declared with other arguments), and when the
// relay gives up (a broker that refuses its credentials): then the consumer
// stops too.
func (s *Stage) Run(ctx context.Context) error {
	err := s.relay.RunBeside(ctx, s.cfg.DrainTimeout, func(ctx context.Context) error {
		s.log.Info("forwarding")
		return s.consumer.Run(ctx)
	})
	counts := s.Counts()
	attrs := make([]any, 0, 2*len(counts))
	for o, n := range counts {
		attrs = append(attrs, string(o), n)
	}
	s.log.Info("stopped", attrs...)
	return err
}

// Handler returns the consumer handler of the stage: it enqueues the
// forwarded copy of each delivery into ob, in the handler's transaction, so
// that the copy is committed together with the key's completion, or not at
// all. A failed insert is an infrastructure failure (retried).
func Handler(ob *outbox.Outbox, exchange, routingKey string) consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		if err := ob.Enqueue(ctx, tx, Message(d, exchange, routingKey)); err != nil {
			return consumer.Response{}, err
		}
		return consumer.Response{}, nil
	}
}

// OrderedHandler is Handler for an ordered stage: a message with an
// x-ordering-key is enqueued with that OrderingKey, so that the relays
// publish its key's messages in the order the stage committed them (with
// the x-sequence it came with, or the outbox's own when it had none).
func OrderedHandler(ob *outbox.Outbox, exchange, routingKey string) consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		m := Message(d, exchange, routingKey)
		m.OrderingKey, _ = d.Headers[consumer.HeaderOrderingKey].(string)
		if err := ob.Enqueue(ctx, tx, m); err != nil {
			return consumer.Response{}, err
		}
		return consumer.Response{}, nil
	}
}

// Message returns the outbox message that forwards d to exchange, with
// routingKey, or when it is empty the routing key d was first published with
// (d.OriginalRoutingKey). See the package documentation for what is kept.
func Message(d *consumer.Delivery, exchange, routingKey string) outbox.Message {
	if routingKey == "" {
		routingKey = d.OriginalRoutingKey
	}
	return outbox.Message{
		Exchange:        exchange,
		RoutingKey:      routingKey,
		Headers:         wire.ForwardHeaders(d.Headers),
		Body:            d.Body,
		ContentType:     d.ContentType,
		MessageID:       cmp.Or(d.MessageID, d.Key),
		CorrelationID:   d.CorrelationID,
		ReplyTo:         d.ReplyTo,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    d.DeliveryMode,
		Priority:        d.Priority,
		Expiration:      d.Expiration,
		Type:            d.Type,
		AppID:           d.AppID,
	}
}
