package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/consumer/internal/kit"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/amqpdial"
	"github.com/idemq/idemq/internal/confirm"
	"github.com/idemq/idemq/internal/interop"
	"github.com/idemq/idemq/internal/keystore"
	"github.com/idemq/idemq/internal/outage"
	"github.com/idemq/idemq/internal/pgfatal"
	"github.com/idemq/idemq/internal/propagator"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/internal/wire"
	"github.com/idemq/idemq/outbox"
)

// instrumentation is the name of the tracer and meter.
const instrumentation = "github.com/idemq/idemq/consumer"

// attrConsumer is the attribute that carries Config.Name, the scope of the
// consumer's keys, on its process spans and on every measurement of its
// metrics (the Prometheus label idemq_consumer); its logs call it "consumer",
// as does the CLI's --consumer flag.
const attrConsumer = "idemq.consumer"

// ErrRetentionTooShort means the key retention is shorter than the longest
// redelivery horizon: a retry arriving after its key was deleted would run
// the handler again.
var ErrRetentionTooShort = errors.New("the key retention is shorter than the redelivery horizon")

// ErrNotReady is wrapped by every error Consumer.Ready returns: the consumer
// is not consuming (not running, not yet connected, reconnecting, stopping,
// or stopped by an error such as an unmigrated schema).
var ErrNotReady = errors.New("consumer not ready")

// Consumer consumes one work queue, claims each message's key before its
// handler runs, and routes every delivery to exactly one outcome.
type Consumer struct {
	store *dedup.Store
	// protocol is the store's side the runtime reserves, completes and
	// releases keys through.
	protocol keystore.Keys
	// outbox is the one in the store's schema, where the handlers'
	// package-level outbox.Enqueue writes.
	outbox  *outbox.Outbox
	handler Handler
	// batchHandler replaces handler in batch mode.
	batchHandler BatchHandler
	// holder holds a group's keys (in its transaction, or as leases), runner
	// runs its handlers (isolated, whole or batch), and isolated is the
	// runner a whole group that failed runs again under: all chosen by New.
	holder   keyHolder
	runner   runner
	isolated isolated
	// partialLimit is how many groups may execute while a group that is
	// not full goes to a free executor (0: any number); see collect.
	partialLimit int
	cfg          Config
	// identify reads a delivery's key and payload (KeyFunc or KeyFrom);
	// traceCarrier wraps its headers for the propagator (KeyFrom: the
	// framework's own trace headers).
	identify     identifier
	traceCarrier func(propagation.TextMapCarrier) propagation.TextMapCarrier
	addrs        amqpdial.Addrs
	topo         Topology
	deathReserve int // see deathReserve
	log          *slog.Logger
	tracer       trace.Tracer
	processSpan  processSpan
	prop         propagation.TextMapPropagator
	metrics      *metrics
	running      atomic.Bool
	// consumed: a session got as far as consuming once; from then on every
	// broker failure is retried.
	consumed atomic.Bool
	// status is what Ready returns (a pointer to nil while consuming).
	status   atomic.Pointer[error]
	failLogs logLimiter
	// outage logs the outages the reconnect loop meets: a line when one
	// starts, at most one per interval while it lasts, one when it ends.
	outage   *outage.Log
	inFlight atomic.Int64
	// keys sign and verify idemq's headers; read by the first session,
	// before its workers start.
	keys wire.Keys
	// crash is the crash test kit's hook (crash.go); nil but in the
	// consumers the kit runs.
	crash kit.Hook
	// parts are the consumers of a partitioned queue's partitions, which
	// Run runs (nil for a queue that is not partitioned).
	parts []*Consumer
}

// newPartitioned returns the consumer of the partitioned queue c.Queue: one
// consumer per partition, each of its own queue Q.p<i> and its own
// connection, all of one scope (c.Name). An ordering key hashes to one
// partition, so its messages meet one consumer.
func newPartitioned(store *dedup.Store, h Handler, bh BatchHandler, c Config, tc TopologyConfig) (*Consumer, error) {
	parent := &Consumer{store: store, cfg: c, topo: NewTopology(tc), log: c.Logger.With("queue", c.Queue, "consumer", c.Name)}
	for i := range c.Partitions {
		pc := c
		pc.Queue, pc.Partitions, pc.partitionOf = PartitionQueue(c.Queue, i), 0, OrderExchange(c.Queue)
		pc.ConnectionName = fmt.Sprintf("%s-p%d", c.ConnectionName, i)
		part, err := newConsumer(store, h, bh, pc)
		if err != nil {
			return nil, err
		}
		parent.parts = append(parent.parts, part)
	}
	parent.notReady(errors.New("not running"))
	return parent, nil
}

// runParts runs every partition's consumer until ctx ends or one of them
// returns an error, which ends the others too.
func (c *Consumer) runParts(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make(chan error, len(c.parts))
	for _, p := range c.parts {
		go func() { errs <- p.Run(ctx) }()
	}
	var first error
	for range c.parts {
		if err := <-errs; err != nil && first == nil {
			first = err
			cancel()
		}
	}
	return first
}

// New returns a consumer of cfg.Queue whose deliveries h handles. A nil cfg
// is invalid (Queue, Name and URL are required). New refuses a store whose
// retention is shorter than the retry horizon, unless Testing.AllowShortRetention.
func New(store *dedup.Store, h Handler, cfg *Config) (*Consumer, error) {
	if h == nil {
		return nil, errors.New("consumer: nil handler")
	}
	return newConsumer(store, h, nil, cfg.withDefaults(DefaultGroupSize))
}

// NewBatch returns a consumer in batch mode: bh handles groups of up to
// cfg.Group.Size deliveries (default DefaultBatchGroupSize) in one
// transaction, with their keys reserved by one statement and completed by
// another. See BatchHandler.
func NewBatch(store *dedup.Store, bh BatchHandler, cfg *Config) (*Consumer, error) {
	if bh == nil {
		return nil, errors.New("consumer: nil batch handler")
	}
	// A delivery that runs alone (its batch failed) is a batch of one.
	single := func(ctx context.Context, tx pgx.Tx, d *Delivery) (Response, error) {
		rs, err := bh(ctx, tx, []*Delivery{d})
		if err != nil || len(rs) != 1 {
			return Response{}, cmp.Or(err, fmt.Errorf("batch handler returned %d responses for 1 delivery", len(rs)))
		}
		return rs[0], nil
	}
	return newConsumer(store, single, bh, cfg.withDefaults(DefaultBatchGroupSize))
}

func newConsumer(store *dedup.Store, h Handler, bh BatchHandler, c Config) (*Consumer, error) {
	if store == nil {
		return nil, errors.New("consumer: nil store")
	}
	tc := c.topologyConfig()
	if err := c.validate(tc); err != nil {
		return nil, fmt.Errorf("consumer: %w", err)
	}
	if bh != nil && c.Ordering != nil {
		return nil, errors.New("consumer: ordering takes a per-message Handler (New), not a batch handler")
	}
	addrs, err := amqpdial.Parse(c.URL)
	if err != nil {
		return nil, fmt.Errorf("consumer: %w", err)
	}
	if c.Partitions > 0 {
		return newPartitioned(store, h, bh, c, tc)
	}
	topo := NewTopology(tc)
	if horizon, retention := topo.horizon(c.MaxAttempts), store.Config().Retention; retention <= horizon {
		if !c.Testing.AllowShortRetention {
			return nil, fmt.Errorf("consumer: %w: retention %s, retries span %s", ErrRetentionTooShort, retention, horizon)
		}
		c.Logger.Warn("key retention is shorter than the retry horizon; late retries may run twice",
			"retention", retention, "horizon", horizon)
	}
	tp := c.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	m, err := newMetrics(c.MeterProvider, c.Queue, c.Name)
	if err != nil {
		return nil, fmt.Errorf("consumer: metrics: %w", err)
	}
	prop := propagator.Or(c.Propagator)
	ob, err := outbox.New(store.Pool(), &outbox.Config{Schema: store.Config().Schema, Propagator: prop})
	if err != nil {
		return nil, fmt.Errorf("consumer: %w", err)
	}
	cons := &Consumer{
		store:        store,
		protocol:     keystore.Of(store),
		outbox:       ob,
		handler:      h,
		batchHandler: bh,
		cfg:          c,
		addrs:        addrs,
		topo:         topo,
		deathReserve: deathReserve(topo),
		log:          c.Logger.With("queue", c.Queue, "consumer", c.Name),
		tracer:       tp.Tracer(instrumentation),
		processSpan:  newProcessSpan(c.Queue, c.Name),
		prop:         prop,
		metrics:      m,
	}
	if cons.identify, err = newIdentifier(&c); err != nil {
		return nil, fmt.Errorf("consumer: %w", err)
	}
	cons.traceCarrier = interop.TraceCarrier(string(c.KeyFrom))
	cons.outage = outage.New(cons.log, "consumer connection", 0)
	if c.Ordering != nil {
		cons.handler = cons.ordered(h)
	}
	cons.holder = cons.newKeyHolder()
	cons.isolated = isolated{c: cons, bare: cons.holder.kept()}
	cons.runner = cons.newRunner()
	if bh != nil {
		cons.partialLimit = batchPartialLimit
	}
	cons.notReady(errors.New("not running"))
	return cons, nil
}

// Config returns the configuration the consumer runs with, defaults filled.
func (c *Consumer) Config() Config { return c.cfg }

// Topology returns the queues and exchanges the consumer uses.
func (c *Consumer) Topology() Topology { return c.topo }

// Ready reports whether the consumer is consuming: nil while it is, else
// an error wrapping ErrNotReady that says why not (not running, not yet
// connected, reconnecting and why, stopping, or the error Run returned).
// It is safe to call at any time, from any goroutine: a readiness probe.
func (c *Consumer) Ready() error {
	if c.parts != nil && c.running.Load() {
		for _, p := range c.parts {
			if err := p.Ready(); err != nil {
				return fmt.Errorf("partition %s: %w", p.cfg.Queue, err)
			}
		}
		return nil
	}
	if p := c.status.Load(); p != nil {
		return *p
	}
	return fmt.Errorf("%w: not made by New", ErrNotReady)
}

// notReady records why the consumer is not consuming.
func (c *Consumer) notReady(why error) {
	err := fmt.Errorf("%w: %w", ErrNotReady, why)
	c.status.Store(&err)
}

// ready records that the consumer is consuming.
func (c *Consumer) ready() {
	var none error
	c.status.Store(&none)
}

// Run consumes until ctx ends, then stops consuming, lets in-flight handlers
// finish (bounded by ShutdownTimeout), acks them and closes; it returns nil
// after a clean stop. A lost connection or channel is redialled with backoff,
// the topology redeclared and consuming resumed; each dial goes through
// the addresses of Config.URL in a fresh random order, so a consumer whose
// node dies resumes on another.
//
// Before it consumes for the first time, Run returns an error for what
// retrying cannot fix: a schema not migrated as far as this build needs
// (dedup.Store.Check; run `idemq migrate`), a Postgres that refuses for
// good (a wrong password, no such role or database, no privilege on the
// schema: SQLSTATE 28P01, 28000, 3D000, 42501), credentials or
// a vhost the broker refuses (403 ACCESS_REFUSED, 530 NOT_ALLOWED), a
// configuration the broker refuses (a queue declared with other arguments,
// a missing queue with SkipDeclare). A broker or database out of reach is
// retried, from the start. Once it has consumed, Run retries every failure.
// It also returns an error when called twice at once.
func (c *Consumer) Run(ctx context.Context) (err error) {
	if !c.running.CompareAndSwap(false, true) {
		return errors.New("consumer: already running")
	}
	defer c.running.Store(false)
	c.notReady(errors.New("not yet connected"))
	defer func() {
		if err == nil {
			c.notReady(errors.New("stopped"))
		} else {
			c.notReady(err)
		}
	}()
	if c.parts != nil {
		return c.runParts(ctx)
	}
	if c.batchHandler == nil && !c.cfg.Group.Optimistic && c.cfg.Group.Size > maxSavepointGroup {
		c.log.Warn("group commit with more savepoints than Postgres caches per transaction; every session's snapshots slow down while such a group runs",
			"group_size", c.cfg.Group.Size, "advised_max", maxSavepointGroup)
	}
	bo := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(200*time.Millisecond),
		backoff.WithMaxInterval(15*time.Second),
		backoff.WithMaxElapsedTime(0),
	)
	checked := false
	for {
		started := time.Now()
		var err error
		if !checked {
			err = c.checkStore(ctx)
			checked = err == nil
		}
		if err == nil {
			err = c.session(ctx)
		}
		if ctx.Err() != nil {
			return nil
		}
		var fatal *fatalError
		if errors.As(err, &fatal) && !c.consumed.Load() {
			return fmt.Errorf("consumer: %w", fatal.err)
		}
		if time.Since(started) > time.Minute {
			bo.Reset()
		}
		wait := bo.NextBackOff()
		if c.consumed.Load() {
			c.notReady(fmt.Errorf("reconnecting: %s", redact.Error(err)))
			c.outage.Failed(ctx, "broker connection lost; reconnecting", err, "in", wait)
		} else {
			c.notReady(fmt.Errorf("not yet connected: %s", redact.Error(err)))
			c.outage.Failed(ctx, "cannot start consuming (never connected yet); retrying", err, "in", wait)
		}
		c.metrics.reconnects.Add(ctx, 1, c.metrics.with())
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
	}
}

// checkStore checks the store's schema (bounded by StoreTimeout): one not
// migrated far enough is a fatal error.
func (c *Consumer) checkStore(ctx context.Context) error {
	sctx, cancel := c.storeCtx(ctx)
	defer cancel()
	err := c.store.Check(sctx)
	if errors.Is(err, dedup.ErrNotMigrated) {
		return &fatalError{err}
	}
	if pgfatal.Refused(err) {
		return &fatalError{pgfatal.Explain(err)}
	}
	return err
}

// fatalError is a session error that retrying will not fix.
type fatalError struct{ err error }

func (e *fatalError) Error() string { return e.err.Error() }

func (e *fatalError) Unwrap() error { return e.err }

// dialer returns the dialer of the consumer's connections: its addresses,
// in a fresh random order on each connect.
func (c *Consumer) dialer() *amqpdial.Dialer {
	return &amqpdial.Dialer{Addrs: c.addrs, Name: c.cfg.ConnectionName, Config: c.cfg.AMQPConfig, Timeout: c.cfg.DialTimeout}
}

// session is one connection's life: declare, consume, handle, until the
// context ends (nil) or the connection or a channel closes (an error).
func (c *Consumer) session(ctx context.Context) error {
	started := c.outage.Attempt()
	conn, err := c.dialer().Dial(context.Background())
	if amqpdial.Refused(err) {
		// Credentials or a vhost the broker refuses: fatal before the first
		// consume.
		return &fatalError{err}
	}
	if err != nil {
		return err
	}
	defer conn.Close()
	connClosed := conn.NotifyClose(make(chan *amqp.Error, 1))

	pubCh, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	pubClosed := pubCh.NotifyClose(make(chan *amqp.Error, 1))
	if !c.cfg.SkipDeclare {
		if err := c.topo.OnBroker(BrokerVersion(conn)).Declare(pubCh); err != nil {
			var amqpErr *amqp.Error
			if errors.As(err, &amqpErr) && amqpErr.Code == amqp.PreconditionFailed || amqpdial.Refused(err) {
				return &fatalError{err}
			}
			return err
		}
	}
	pub, err := confirm.New(pubCh, conn.Config.FrameSize)
	if err != nil {
		return err
	}

	if c.keys == nil {
		if c.keys, err = c.headerKeys(ctx); err != nil {
			return err
		}
	}

	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	chClosed := ch.NotifyClose(make(chan *amqp.Error, 1))
	if err := ch.Qos(c.cfg.Prefetch, 0, false); err != nil {
		return fmt.Errorf("set prefetch: %w", err)
	}
	tag := fmt.Sprintf("%s-%p", c.cfg.Name, conn)
	deliveries, err := ch.Consume(c.cfg.Queue, tag, false, false, false, false, nil)
	if err != nil {
		var amqpErr *amqp.Error
		if errors.As(err, &amqpErr) && amqpErr.Code == amqp.NotFound || amqpdial.Refused(err) {
			return &fatalError{fmt.Errorf("consume %s: %w", c.cfg.Queue, err)}
		}
		return fmt.Errorf("consume %s: %w", c.cfg.Queue, err)
	}
	c.consumed.Store(true)
	c.ready()
	c.outage.Recovered(ctx, started)
	c.log.Info("consuming", "broker", conn.RemoteAddr().String(), "concurrency", c.cfg.Concurrency, "prefetch", c.cfg.Prefetch)

	// Handlers run under hard: it outlives ctx by up to ShutdownTimeout.
	hard, hardStop := context.WithCancel(context.WithoutCancel(ctx))
	defer hardStop()
	s := &session{pub: pub, stop: make(chan struct{}), budget: newByteBudget(int64(c.cfg.MaxInFlightBytes))}
	if !c.cfg.IndividualAcks {
		s.acks = newAckWindow(ch, c.cfg.Prefetch, func(err error) {
			c.log.Warn("ack failed; the broker redelivers the unacked messages", "err", redact.Error(err))
		})
		defer s.acks.stop()
	}
	// The library hands deliveries over one by one on an unbuffered channel;
	// a buffer as deep as the prefetch lets a worker take a whole group at
	// once. Deliveries left in it at a stop are never acked: the broker
	// redelivers them. Over MaxInFlightBytes, no more are taken until some
	// settle (the library then holds them, up to the prefetch).
	buffered := make(chan amqp.Delivery, c.cfg.Prefetch)
	closeBuffered := func() { close(buffered) }
	owner := c.newOwnerMark()
	defer owner.end()
	if c.cfg.Ordering != nil {
		s.gate = newOrderGate(c, s, buffered)
		closeBuffered = s.gate.close
		go s.gate.run()
	}
	go func() {
		defer closeBuffered()
		for d := range deliveries {
			owner.delivered()
			if s.acks != nil {
				s.acks.track(d.DeliveryTag)
			}
			if !s.budget.take(int64(len(d.Body)), s.stop) {
				return
			}
			if s.gate != nil {
				s.gate.admit(d)
				continue
			}
			select {
			case buffered <- d:
			case <-s.stop:
				return
			}
		}
	}()
	workersDone := c.runPipeline(hard, s, buffered)

	var lost error
	select {
	case <-ctx.Done():
	case e := <-connClosed:
		lost = fmt.Errorf("connection closed: %w", closeReason(e))
	case e := <-chClosed:
		lost = fmt.Errorf("consumer channel closed: %w", closeReason(e))
	case e := <-pubClosed:
		lost = fmt.Errorf("publisher channel closed: %w", closeReason(e))
	case <-workersDone:
		lost = errors.New("delivery channel closed")
	}
	if lost != nil {
		c.notReady(fmt.Errorf("reconnecting: %s", redact.Error(lost)))
	} else {
		c.notReady(errors.New("stopping"))
	}
	close(s.stop)
	if lost != nil {
		// Whatever is in flight can no longer be acked on this channel: stop
		// it; the broker redelivers and the keys make that harmless.
		hardStop()
		<-workersDone
		return lost
	}
	// Graceful stop: no new deliveries; let in-flight handlers finish and ack.
	_ = ch.Cancel(tag, false)
	select {
	case <-workersDone:
	case <-time.After(c.cfg.ShutdownTimeout):
		c.log.Warn("shutdown timeout: cancelling in-flight handlers", "in_flight", c.inFlight.Load())
		hardStop()
		<-workersDone
	}
	s.flushAll()
	_ = ch.Close()
	return nil
}

// session is the state workers share during one connection.
type session struct {
	pub    publisher
	stop   chan struct{}
	acks   *ackWindow // nil with IndividualAcks
	budget *byteBudget
	// gate orders the deliveries of an ordered consumer (nil otherwise).
	gate *orderGate
}

// publisher publishes the copies that settle deliveries and waits for the
// broker's confirm: a confirm.Publisher on the session's channel, or the
// test kit's recorder (direct.go).
type publisher interface {
	PublishWait(ctx context.Context, exchange, routingKey string, msg amqp.Publishing) error
	// FrameMax is the connection's frame_max, which a copy must fit in.
	FrameMax() int
}

// flush sends the acks made ready so far (see ackWindow).
func (s *session) flush() {
	if s.acks != nil {
		s.acks.flush()
	}
}

// flushAll sends every ready ack; the session is ending.
func (s *session) flushAll() {
	if s.acks != nil {
		s.acks.flushAll()
	}
}

// nack returns d to its queue at once.
func (s *session) nack(d *amqp.Delivery) {
	if s.acks != nil {
		_ = s.acks.nack(d.DeliveryTag)
		return
	}
	_ = d.Nack(false, true)
}

// closeReason is the error a Notify*Close channel delivered; a nil one
// means a close without an error (the library closed the channel).
func closeReason(e *amqp.Error) error {
	if e == nil {
		return errors.New("no error given")
	}
	return e
}
