package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/amqpdial"
)

// DefaultDialTimeout bounds the connect to one broker address (TCP, TLS and
// the AMQP handshake) where a Config or a TopologyConfig leaves DialTimeout
// zero.
const DefaultDialTimeout = 30 * time.Second

// TopologyConfig shapes the topology of one work queue: what NewTopology
// and Apply take. Zero fields take the defaults a Config's take, so that a
// consumer with the same Queue and retry settings declares the same
// topology; Config.TopologyConfig gives a consumer's own.
type TopologyConfig struct {
	// Queue is the work queue Q. Required.
	Queue string
	// MaxAttempts is how many times a message is handled before it is
	// dead-lettered: MaxAttempts-1 retries, one tier per distinct delay.
	// Default 5.
	MaxAttempts int
	// RetryInitial, RetryMultiplier and RetryMax shape the exponential
	// backoff whose delays name the retry tiers. Defaults 1s, ×5, 10m.
	RetryInitial    time.Duration
	RetryMultiplier float64
	RetryMax        time.Duration
	// DeliveryLimit is the work queue's x-delivery-limit. Default 20.
	DeliveryLimit int
	// ClassicQueues declares classic queues instead of quorum queues.
	ClassicQueues bool
	// QuorumInitialGroupSize, when positive, is every quorum queue's
	// x-quorum-initial-group-size: how many cluster nodes get a replica at
	// declaration. Zero leaves it to the broker (rabbit.quorum_cluster_size,
	// default 3: every node of a three-node cluster). See docs/topology.md.
	QuorumInitialGroupSize int
	// Bindings bind the work queue to exchanges that publishers publish to.
	// Retry and dead-letter copies never go through them (docs/topology.md).
	Bindings []Binding
	// Partitions, when positive, splits the work queue Q into that many
	// partitions for ordered consumption (DESIGN section 12): publishers
	// publish to the exchange Q.order (x-consistent-hash on the header
	// x-ordering-key), which spreads the ordering keys over the quorum
	// queues Q.p0 … Q.p{N-1}, each with single-active-consumer, its retry
	// tiers and its DLQ. No queue Q is declared. See docs/ordering.md.
	Partitions int

	// AMQPConfig, when set, is the base of Apply's connection config
	// (TLSClientConfig, vhost, a Dial function of its own).
	AMQPConfig *amqp.Config
	// ConnectionName names Apply's connection in the broker's UI. Default
	// "idemq-topology".
	ConnectionName string
	// DialTimeout bounds Apply's connect, handshake included. Default 30s.
	DialTimeout time.Duration

	// partitionOf is the order exchange of the partitioned queue this one
	// is a partition of ("" for none).
	partitionOf string
}

// partition is the configuration of partition i of a partitioned c.
func (c TopologyConfig) partition(i int) TopologyConfig {
	p := c
	p.Queue, p.Partitions, p.partitionOf = PartitionQueue(c.Queue, i), 0, OrderExchange(c.Queue)
	return p
}

// WithDefaults returns a copy of c with every zero field set to its default.
func (c TopologyConfig) WithDefaults() TopologyConfig {
	c.MaxAttempts = cmp.Or(c.MaxAttempts, DefaultMaxAttempts)
	c.RetryInitial = cmp.Or(c.RetryInitial, DefaultRetryInitial)
	c.RetryMultiplier = cmp.Or(c.RetryMultiplier, DefaultRetryMultiplier)
	c.RetryMax = cmp.Or(c.RetryMax, DefaultRetryMax)
	c.DeliveryLimit = cmp.Or(c.DeliveryLimit, DefaultDeliveryLimit)
	c.ConnectionName = cmp.Or(c.ConnectionName, "idemq-topology")
	c.DialTimeout = cmp.Or(c.DialTimeout, DefaultDialTimeout)
	return c
}

// Validate reports what is wrong with c once its defaults are filled in
// (WithDefaults): what Apply and New refuse.
func (c TopologyConfig) Validate() error {
	var errs []error
	if c.Queue == "" {
		errs = append(errs, errors.New("queue name is required"))
	}
	if c.MaxAttempts < 1 {
		errs = append(errs, fmt.Errorf("max attempts %d must be positive", c.MaxAttempts))
	}
	if c.RetryMultiplier < 1 {
		errs = append(errs, fmt.Errorf("retry multiplier %g must be at least 1", c.RetryMultiplier))
	}
	if c.DialTimeout < 0 {
		errs = append(errs, fmt.Errorf("dial timeout %s must not be negative", c.DialTimeout))
	}
	if c.Partitions < 0 || c.Partitions > MaxPartitions {
		errs = append(errs, fmt.Errorf("partitions %d must be between 0 and %d", c.Partitions, MaxPartitions))
	}
	if c.Partitions > 0 && len(c.Bindings) > 0 {
		errs = append(errs, fmt.Errorf("a partitioned queue takes no bindings: publishers publish to %s", OrderExchange(c.Queue)))
	}
	if c.QuorumInitialGroupSize < 0 {
		errs = append(errs, fmt.Errorf("quorum initial group size %d must not be negative", c.QuorumInitialGroupSize))
	}
	for _, b := range c.Bindings {
		if err := b.validate(c.Queue); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Binding binds a work queue to an exchange that publishers (often of
// other teams) publish to. Only the original publishes arrive through it:
// idemq sends its retry copies to the queue's tiers through the default
// exchange, the tiers dead-letter them back to the queue by name, and dead
// letters go to Q.dlx, so other queues bound to the same exchange never see
// a copy.
type Binding struct {
	// Exchange is the exchange bound from. Required: the default exchange
	// takes no bindings.
	Exchange string
	// Kind is the exchange's type (amqp.ExchangeTopic, ExchangeDirect,
	// ExchangeFanout, ExchangeHeaders or a plugin's type). Required when
	// Declare is set.
	Kind string
	// Key is the binding key: the routing key of a direct exchange, a
	// pattern of a topic exchange (order.*, order.#). Fanout and headers
	// exchanges ignore it.
	Key string
	// Args are the binding's arguments: what a headers exchange matches
	// (x-match all or any, and the header values).
	Args amqp.Table
	// Declare declares the exchange (durable, of Kind) before binding, as
	// idempotently as the queues. Without it the exchange must exist: it
	// belongs to the publishers' topology, and binding to a missing one
	// fails with NOT_FOUND.
	Declare bool
}

func (b Binding) validate(queue string) error {
	switch {
	case b.Exchange == "":
		return fmt.Errorf("binding of %s: exchange name is required (the default exchange takes no bindings)", queue)
	case b.Exchange == queue+".dlx":
		return fmt.Errorf("binding of %s to %s: its own dead-letter exchange would send dead letters back to it", queue, b.Exchange)
	case b.Declare && b.Kind == "":
		return fmt.Errorf("binding of %s to %s: declaring the exchange needs its kind", queue, b.Exchange)
	}
	if err := b.Args.Validate(); err != nil {
		return fmt.Errorf("binding of %s to %s: arguments: %w", queue, b.Exchange, err)
	}
	return nil
}

// String is how the CLI and the docs write a binding:
// exchange[:kind]:key, and a headers binding's arguments as
// exchange:kind:name=value,… (sorted by name).
func (b Binding) String() string {
	s := b.Exchange
	if b.Kind != "" {
		s += ":" + b.Kind
	}
	s += ":" + b.Key
	if len(b.Args) > 0 {
		args := make([]string, 0, len(b.Args))
		for k, v := range b.Args {
			args = append(args, fmt.Sprintf("%s=%v", k, v))
		}
		slices.Sort(args)
		if b.Key != "" {
			s += " "
		}
		s += strings.Join(args, ",")
	}
	return s
}

// MaxPartitions bounds TopologyConfig.Partitions.
const MaxPartitions = 256

// OrderExchange is the exchange publishers of a partitioned queue q publish
// to: q.order, of type x-consistent-hash on the header x-ordering-key.
func OrderExchange(q string) string { return q + ".order" }

// PartitionQueue is the name of partition i of q: q.p<i>.
func PartitionQueue(q string, i int) string { return fmt.Sprintf("%s.p%d", q, i) }

// orderExchangeArgs hash the ordering key header rather than the routing
// key.
var orderExchangeArgs = amqp.Table{"hash-header": "x-ordering-key"}

// consistentHash is the exchange type of RabbitMQ's plugin
// rabbitmq_consistent_hash_exchange.
const consistentHash = "x-consistent-hash"

// Topology names the queues and exchanges of one work queue Q:
//
//	Q                 the work queue (quorum, x-delivery-limit, dead-letters to Q.dlx)
//	Q.retry.<delay>   one delay tier per retry delay (TTL, dead-letters back to Q)
//	Q.dlx → Q.dlq     the dead-letter exchange (fanout) and queue
//
// A partitioned Q (TopologyConfig.Partitions) is the exchange Q.order and
// its Partitions, each a Topology of its own (Q.p0, Q.p0.retry.<delay>,
// Q.p0.dlx → Q.p0.dlq, …); Q itself is not declared.
type Topology struct {
	// Queue is the work queue Q.
	Queue string
	// DLX and DLQ are Q.dlx and Q.dlq.
	DLX, DLQ string
	// Delays are the delays of the retry tiers, shortest first.
	Delays []time.Duration
	// ClassicQueues: the queues are classic, not quorum, queues.
	ClassicQueues bool
	// DeliveryLimit is the work queue's x-delivery-limit (quorum queues only).
	DeliveryLimit int
	// QuorumInitialGroupSize is the quorum queues'
	// x-quorum-initial-group-size; 0: not set, the broker's default.
	QuorumInitialGroupSize int
	// Bindings bind the work queue to publishers' exchanges.
	Bindings []Binding
	// OrderExchange is the x-consistent-hash exchange a partition is bound
	// to (and that a partitioned topology declares); "" for a queue that is
	// not partitioned.
	OrderExchange string
	// SingleActiveConsumer: the work queue delivers to one consumer at a
	// time (x-single-active-consumer), the others standing by: a
	// partition's.
	SingleActiveConsumer bool
	// Partitions are the partitions of a partitioned queue, Q.p0 first.
	Partitions []Topology
	// BrokerVersion is the version of the RabbitMQ server the topology is
	// declared on (its server property "version", BrokerVersion reads it;
	// OnBroker sets it): on RabbitMQ 4 and later, whose quorum queues have
	// a delivery limit of 20 unless told otherwise, the DLQ and the retry
	// tiers are declared with x-delivery-limit -1 (no limit), so that no
	// read of a DLQ (each returns its letters, which counts a delivery) and
	// no redelivery drops a letter. "" (and 3.x): the 3.x arguments, with
	// no limit either way.
	BrokerVersion string
}

// BrokerVersion returns the version conn's server gave ("3.10.7",
// "4.0.5"), "" when it gave none.
func BrokerVersion(conn *amqp.Connection) string {
	v, _ := conn.Properties["version"].(string)
	return v
}

// OnBroker returns t for the server of version (BrokerVersion), its
// partitions too.
func (t Topology) OnBroker(version string) Topology {
	t.BrokerVersion = version
	if len(t.Partitions) > 0 {
		ps := make([]Topology, len(t.Partitions))
		for i, p := range t.Partitions {
			ps[i] = p.OnBroker(version)
		}
		t.Partitions = ps
	}
	return t
}

// limitsDeliveries reports whether the broker gives quorum queues a
// delivery limit by default: RabbitMQ 4.0 and later (20), which take -1
// for no limit; 3.x has no default limit, and refuses -1.
func (t Topology) limitsDeliveries() bool {
	major, _, _ := strings.Cut(t.BrokerVersion, ".")
	n, err := strconv.Atoi(major)
	return !t.ClassicQueues && err == nil && n >= 4
}

// noDeliveryLimit is the x-delivery-limit that lifts RabbitMQ 4's default.
const noDeliveryLimit = int64(-1)

// NewTopology returns the topology cfg shapes (defaults applied).
func NewTopology(cfg TopologyConfig) Topology {
	c := cfg.WithDefaults()
	if c.Partitions > 0 {
		t := Topology{Queue: c.Queue, OrderExchange: OrderExchange(c.Queue)}
		for i := range c.Partitions {
			t.Partitions = append(t.Partitions, NewTopology(c.partition(i)))
		}
		t.Delays, t.ClassicQueues, t.DeliveryLimit = t.Partitions[0].Delays, c.ClassicQueues, c.DeliveryLimit
		return t
	}
	return Topology{
		OrderExchange:        c.partitionOf,
		SingleActiveConsumer: c.partitionOf != "",
		Queue:                c.Queue,
		DLX:                  c.Queue + ".dlx",
		DLQ:                  c.Queue + ".dlq",
		Delays:               retryDelays(c.RetryInitial, c.RetryMultiplier, c.RetryMax, c.MaxAttempts),
		ClassicQueues:        c.ClassicQueues,
		DeliveryLimit:        c.DeliveryLimit,
		Bindings:             c.Bindings,

		QuorumInitialGroupSize: c.QuorumInitialGroupSize,
	}
}

// retryDelays returns the delay before each retry, as cenkalti/backoff's
// exponential policy (no jitter: the delays name fixed tiers) computes them:
// one delay per retry, maxAttempts-1 in all, duplicates removed.
func retryDelays(initial time.Duration, multiplier float64, maxDelay time.Duration, maxAttempts int) []time.Duration {
	b := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(initial),
		backoff.WithMultiplier(multiplier),
		backoff.WithMaxInterval(maxDelay),
		backoff.WithRandomizationFactor(0),
		backoff.WithMaxElapsedTime(0),
	)
	var out []time.Duration
	for range maxAttempts - 1 {
		d := b.NextBackOff().Round(time.Millisecond)
		if len(out) == 0 || out[len(out)-1] != d {
			out = append(out, d)
		}
	}
	if len(out) == 0 {
		// A delay tier still serves busy keys and lost leases.
		out = append(out, initial)
	}
	return out
}

// horizon is the longest time from a message's first delivery to its last
// retry: the sum of the delays of all retries. Keys must be retained longer.
func (t Topology) horizon(maxAttempts int) time.Duration {
	var sum time.Duration
	for i := 1; i < maxAttempts; i++ {
		sum += t.delayFor(i)
	}
	return sum
}

// delayFor is the delay before the retry that follows attempt n (1-based).
func (t Topology) delayFor(n int) time.Duration {
	if n-1 < len(t.Delays) {
		return t.Delays[n-1]
	}
	return t.Delays[len(t.Delays)-1]
}

// TierFor returns the retry tier a message waits in after its attempt n
// (1-based) failed, before its next attempt: the tier of the nth delay, the
// longest for the attempts beyond.
func (t Topology) TierFor(n int) string { return t.TierName(t.delayFor(n)) }

// tierAtLeast returns the shortest tier whose delay is at least d (the
// longest if none is): where busy keys wait for a lease to end.
func (t Topology) tierAtLeast(d time.Duration) string {
	for _, delay := range t.Delays {
		if delay >= d {
			return t.TierName(delay)
		}
	}
	return t.TierName(t.Delays[len(t.Delays)-1])
}

// Names lists the queues and the exchanges t declares (of every partition
// of a partitioned t), the work queues first.
func (t Topology) Names() (queues, exchanges []string) {
	if t.OrderExchange != "" && len(t.Partitions) > 0 {
		exchanges = append(exchanges, t.OrderExchange)
	}
	if len(t.Partitions) > 0 {
		for _, p := range t.Partitions {
			q, x := p.Names()
			queues, exchanges = append(queues, q...), append(exchanges, x...)
		}
		return queues, exchanges
	}
	queues = append(queues, t.Queue)
	for _, d := range t.Delays {
		queues = append(queues, t.TierName(d))
	}
	return append(queues, t.DLQ), append(exchanges, t.DLX)
}

// TierName is the queue name of the tier with delay d.
func (t Topology) TierName(d time.Duration) string {
	return fmt.Sprintf("%s.retry.%s", t.Queue, d)
}

func (t Topology) queueArgs(extra amqp.Table) amqp.Table {
	args := amqp.Table{}
	if !t.ClassicQueues {
		args["x-queue-type"] = "quorum"
		// At-least-once dead-lettering, which RabbitMQ honours only with
		// reject-publish overflow; otherwise it falls back to at-most-once.
		args["x-dead-letter-strategy"] = "at-least-once"
		args["x-overflow"] = "reject-publish"
		if t.QuorumInitialGroupSize > 0 {
			args["x-quorum-initial-group-size"] = int64(t.QuorumInitialGroupSize)
		}
	}
	for k, v := range extra {
		args[k] = v
	}
	return args
}

// WorkQueueArgs are the arguments Declare gives the work queue.
func (t Topology) WorkQueueArgs() amqp.Table {
	work := amqp.Table{"x-dead-letter-exchange": t.DLX}
	if t.SingleActiveConsumer {
		work["x-single-active-consumer"] = true
	}
	if !t.ClassicQueues {
		work["x-delivery-limit"] = int64(t.DeliveryLimit)
	}
	return t.queueArgs(work)
}

// TierArgs are the arguments Declare gives the retry tier of delay d: on
// RabbitMQ 4 and later (BrokerVersion), with no delivery limit.
func (t Topology) TierArgs(d time.Duration) amqp.Table {
	tier := amqp.Table{
		"x-message-ttl":             d.Milliseconds(),
		"x-dead-letter-exchange":    "",
		"x-dead-letter-routing-key": t.Queue,
	}
	if t.limitsDeliveries() {
		tier["x-delivery-limit"] = noDeliveryLimit
	}
	return t.queueArgs(tier)
}

// DLQArgs are the arguments Declare gives the dead-letter queue: on
// RabbitMQ 4 and later (BrokerVersion), with no delivery limit, so that
// reading it (idemq dlq list, the UI) never drops a letter.
func (t Topology) DLQArgs() amqp.Table {
	if t.limitsDeliveries() {
		return t.queueArgs(amqp.Table{"x-delivery-limit": noDeliveryLimit})
	}
	return t.queueArgs(nil)
}

// declareKept declares queue name with args; a queue that exists without
// the delivery limit RabbitMQ 4 needs lifted (declared before the upgrade)
// is an error that says what to do.
func (t Topology) declareKept(ch *amqp.Channel, name string, args amqp.Table) error {
	_, err := ch.QueueDeclare(name, true, false, false, false, args)
	var amqpErr *amqp.Error
	if err != nil && t.limitsDeliveries() && errors.As(err, &amqpErr) && amqpErr.Code == amqp.PreconditionFailed &&
		strings.Contains(amqpErr.Reason, "x-delivery-limit") {
		return fmt.Errorf("declare queue %s: %w: it was declared without x-delivery-limit, before RabbitMQ %s, "+
			"which limits its deliveries to 20 (every read of a DLQ counts one, and a letter beyond it is dropped): "+
			"move its messages out (a shovel, or idemq dlq replay for a DLQ), delete it and declare it again (docs/topology.md, RabbitMQ 4)",
			name, err, t.BrokerVersion)
	}
	if err != nil {
		return fmt.Errorf("declare queue %s: %w", name, err)
	}
	return nil
}

// Declare declares the whole topology on ch, the work queue's bindings
// last (with the exchanges they declare). It is idempotent: declaring
// again with the same configuration changes nothing.
func (t Topology) Declare(ch *amqp.Channel) error {
	if t.OrderExchange != "" {
		if err := ch.ExchangeDeclare(t.OrderExchange, consistentHash, true, false, false, false, orderExchangeArgs); err != nil {
			return fmt.Errorf("declare exchange %s (%s; RabbitMQ's plugin rabbitmq_consistent_hash_exchange must be enabled): %w",
				t.OrderExchange, consistentHash, err)
		}
	}
	if len(t.Partitions) > 0 {
		for _, p := range t.Partitions {
			if err := p.Declare(ch); err != nil {
				return err
			}
		}
		return nil
	}
	if err := ch.ExchangeDeclare(t.DLX, amqp.ExchangeFanout, true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange %s: %w", t.DLX, err)
	}
	if err := t.declareKept(ch, t.DLQ, t.DLQArgs()); err != nil {
		return err
	}
	if err := ch.QueueBind(t.DLQ, "", t.DLX, false, nil); err != nil {
		return fmt.Errorf("bind %s to %s: %w", t.DLQ, t.DLX, err)
	}
	if _, err := ch.QueueDeclare(t.Queue, true, false, false, false, t.WorkQueueArgs()); err != nil {
		return fmt.Errorf("declare queue %s: %w", t.Queue, err)
	}
	for _, d := range t.Delays {
		if err := t.declareKept(ch, t.TierName(d), t.TierArgs(d)); err != nil {
			return err
		}
	}
	if t.OrderExchange != "" {
		// Each partition weighs the same in the hash ring.
		if err := ch.QueueBind(t.Queue, "1", t.OrderExchange, false, nil); err != nil {
			return fmt.Errorf("bind %s to exchange %s: %w", t.Queue, t.OrderExchange, err)
		}
	}
	for _, b := range t.Bindings {
		if b.Declare {
			if err := ch.ExchangeDeclare(b.Exchange, b.Kind, true, false, false, false, nil); err != nil {
				return fmt.Errorf("declare exchange %s (%s): %w", b.Exchange, b.Kind, err)
			}
		}
		if err := ch.QueueBind(t.Queue, b.Key, b.Exchange, false, b.Args); err != nil {
			return fmt.Errorf("bind %s to exchange %s with key %q: %w", t.Queue, b.Exchange, b.Key, err)
		}
	}
	return nil
}

// Apply dials the broker at url (one AMQP URL, or several separated by
// commas: the first that answers, tried in random order), declares the topology cfg shapes (as
// Topology.Declare: idempotent) and closes the connection. The connect is
// bounded by cfg.DialTimeout; the whole of it ends when ctx does.
func Apply(ctx context.Context, url string, cfg TopologyConfig) error {
	c := cfg.WithDefaults()
	if err := c.Validate(); err != nil {
		return fmt.Errorf("apply topology: %w", err)
	}
	addrs, err := amqpdial.Parse(url)
	if err != nil {
		return fmt.Errorf("apply topology: %w", err)
	}
	d := amqpdial.Dialer{Addrs: addrs, Name: c.ConnectionName, Config: c.AMQPConfig, Timeout: c.DialTimeout}
	conn, err := d.Dial(ctx)
	if err != nil {
		return fmt.Errorf("apply topology: %w", err)
	}
	defer conn.Close()
	// The channel methods take no context: closing the connection when ctx
	// ends unblocks them.
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	defer stop()
	err = declareOn(conn, NewTopology(c))
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("apply topology to %s: %w (%w)", c.Queue, context.Cause(ctx), err)
		}
		return fmt.Errorf("apply topology to %s: %w", c.Queue, err)
	}
	return nil
}

// declareOn declares t on a channel of its own of conn.
func declareOn(conn *amqp.Connection, t Topology) error {
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	defer ch.Close()
	return t.OnBroker(BrokerVersion(conn)).Declare(ch)
}
