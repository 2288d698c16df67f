package consumer

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/dedup"
)

// Defaults used where a Config leaves a field zero.
const (
	DefaultConcurrency = 8
	// DefaultGroupSize is the group commit of a per-message Handler: half
	// of the 64 savepoints a Postgres backend caches (maxSavepointGroup),
	// the size that measured best below it (docs/benchmarks.md).
	DefaultGroupSize = 32
	// DefaultBatchGroupSize is the default Group.Size of a consumer made
	// by NewBatch.
	DefaultBatchGroupSize  = 100
	DefaultMaxAttempts     = 5
	DefaultDeliveryLimit   = 20
	DefaultHandlerTimeout  = time.Minute
	DefaultShutdownTimeout = 30 * time.Second
	DefaultTenantHeader    = "x-tenant-id"
	DefaultKeyHeader       = "Idempotency-Key"
	DefaultRetryInitial    = time.Second
	DefaultRetryMultiplier = 5.0
	DefaultRetryMax        = 10 * time.Minute
	DefaultPublishTimeout  = 30 * time.Second
	DefaultStoreTimeout    = 30 * time.Second
	// DefaultMaxInFlightBytes is the default MaxInFlightBytes: 64 MiB.
	DefaultMaxInFlightBytes = 64 << 20
	// DefaultGapTimeout is the default Ordering.GapTimeout.
	DefaultGapTimeout = 5 * time.Minute
)

// KeyFunc extracts the idempotency key from a delivery. Return "" when there
// is none.
type KeyFunc func(d *amqp.Delivery) string

// Config configures a Consumer. Queue, Name and URL are required.
type Config struct {
	// URL is the AMQP URL (amqp:// or amqps://), or several separated by
	// commas: the nodes of a cluster, tried in a random order on each
	// connect (docs/consumer.md, "Connections and shutdown"). Never logged.
	URL string
	// AMQPConfig, when set, is the base connection config: TLSClientConfig
	// for amqps:// with client certificates, heartbeat, vhost.
	AMQPConfig *amqp.Config
	// Queue is the work queue Q; the topology adds Q.retry.<delay>, Q.dlx, Q.dlq.
	Queue string
	// Name is the stable name of the handler: keys are unique per
	// (Name, tenant, key), the dedup.Scope's Consumer. Two handlers of one
	// message need two names. It is the --consumer of the idemq CLI, the
	// attribute idemq.consumer of the process spans and metrics, and the
	// field "consumer" of the logs.
	Name string

	// Concurrency is the number of deliveries handled at once. Default 8.
	Concurrency int
	// Prefetch is the channel's QoS prefetch count. Default
	// (Concurrency+1) × Group.Size (a group for every executor and one
	// filling), at least 2 × Concurrency.
	Prefetch int
	// Group is group commit: how deliveries are gathered into one
	// transaction. Default: groups of up to DefaultGroupSize, no linger,
	// a savepoint per handler; DefaultBatchGroupSize for NewBatch.
	Group Group
	// SeparateReservations reserves each group's keys with a statement of
	// their own, committed before the handlers run: leases others can see
	// (a copy elsewhere finds its key busy), extended by a heartbeat. By
	// default the keys are held in the group's transaction, in every mode:
	// one commit per group (docs/consumer.md, "Holding keys").
	SeparateReservations bool
	// Steps declares that the handlers call Delivery.Step, whose
	// transactions must see the key: it implies SeparateReservations. A
	// handler that calls Step without it gets ErrStepInBatch.
	Steps bool
	// IndividualAcks acks every delivery with a frame of its own instead
	// of coalesced multiple-acks (docs/consumer.md, "Acks"). Either way no
	// delivery is acked before its outcome is durable.
	IndividualAcks bool
	// HandlerTimeout bounds one call of user code, the same in every mode:
	// a Handler's call for one delivery, a BatchHandler's call for its
	// batch (an infrastructure failure when exceeded). The completion and
	// commit that follow are bounded by StoreTimeout. Default 1 minute.
	HandlerTimeout time.Duration
	// ShutdownTimeout bounds how long in-flight handlers may finish after
	// the context ends. Default 30s.
	ShutdownTimeout time.Duration
	// PublishTimeout bounds the wait for a publisher confirm. Default 30s.
	PublishTimeout time.Duration
	// StoreTimeout bounds each key-store call the runtime makes on its own
	// behalf (reserve, release, a group's begin, savepoints, completion,
	// commit, rollback); one that times out is an infrastructure failure
	// (docs/consumer.md, "Deadlines on every database call"). Default 30s.
	StoreTimeout time.Duration
	// MaxInFlightBytes bounds the body bytes of the deliveries taken and
	// not yet settled; over it the runtime takes no more until some settle
	// (docs/consumer.md, "Memory: deliveries in flight", says what it does
	// not cover). Default 64 MiB.
	MaxInFlightBytes int

	// Lease overrides the store's lease for this consumer's keys when positive.
	Lease time.Duration

	// MaxAttempts is how many times a message is handled before it goes to
	// the DLQ with reason max_attempts_exceeded. Default 5.
	MaxAttempts int
	// RetryInitial, RetryMultiplier and RetryMax shape the exponential
	// backoff (cenkalti/backoff) whose delays name the retry tiers.
	// Defaults 1s, ×5, 10m: tiers 1s, 5s, 25s, 2m5s for 5 attempts.
	RetryInitial    time.Duration
	RetryMultiplier float64
	RetryMax        time.Duration
	// DeliveryLimit is the work queue's x-delivery-limit: the broker's last
	// safety net for messages that crash the worker before they are routed.
	// Default 20.
	DeliveryLimit int
	// ClassicQueues declares classic queues instead of quorum queues (for
	// brokers without quorum support; dead-lettering is then at-most-once).
	ClassicQueues bool
	// QuorumInitialGroupSize, when positive, sets every quorum queue's
	// x-quorum-initial-group-size (TopologyConfig.QuorumInitialGroupSize).
	// Zero, the default, leaves the replica count to the broker.
	QuorumInitialGroupSize int
	// Bindings bind the work queue to the exchanges its messages are
	// published to (declared with the rest of the topology, on connect).
	// Retry and dead-letter copies never go back through them.
	Bindings []Binding
	// Partitions, when positive, consumes the partitions Q.p0 …
	// Q.p{N-1} of a partitioned Q (TopologyConfig.Partitions): one session
	// per partition, each single-active-consumer, so that one worker at a
	// time takes each partition and the others stand by.
	Partitions int
	// Ordering, when set, keeps each ordering key's messages in order
	// (docs/ordering.md): one at a time per key, and with x-sequence, each
	// sequence applied once and in order, recorded in the handler's
	// transaction.
	Ordering *Ordering
	// SkipDeclare leaves the topology alone (it was applied by `idemq
	// topology apply` or by an operator) instead of declaring it on connect.
	SkipDeclare bool

	// KeyFunc extracts the key; default: message_id, else the Idempotency-Key header.
	KeyFunc KeyFunc
	// KeyFrom reads the key, and the payload Fingerprint is computed over,
	// as a framework writes them: MassTransit, NServiceBus, Wolverine or
	// CloudEvents (KeyPreset). Default KeyFromMessageID. Not with KeyFunc.
	KeyFrom KeyPreset
	// KeyHeader is the header read when there is no message_id. Default "Idempotency-Key".
	KeyHeader string
	// TenantHeader names the header carrying the tenant. Default "x-tenant-id".
	TenantHeader string
	// TenantFromUserID takes the tenant from the AMQP user_id property, which
	// RabbitMQ checks against the publishing connection's user, instead of a
	// header that any publisher can write.
	TenantFromUserID bool
	// Fingerprint computes the operation's fingerprint; default: the whole
	// payload. The payload is the body, or with a KeyFrom preset the part
	// of the message the framework's payload is (KeyPreset).
	Fingerprint dedup.Fingerprinter

	// HeaderKeys are the HMAC-SHA256 keys (at least 16 random bytes each,
	// the same in every worker of a queue) that sign idemq's own headers on
	// the copies it publishes: the first signs, every key verifies
	// (docs/security.md, rotation). Nil: the keys of the store's schema
	// (table header_keys), read when Run connects.
	HeaderKeys [][]byte

	// NoReply stops the runtime from answering reply_to with the stored
	// response (for stages that forward the message to the real handler).
	NoReply bool
	// LogKeys puts raw keys into span attributes (off: a short hash only;
	// logs always carry only the hash).
	LogKeys bool

	// Logger receives structured logs; nil means slog.Default().
	Logger *slog.Logger
	// TracerProvider and MeterProvider; nil means the global ones.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider
	// Propagator reads the trace context a delivery carries in its headers
	// and writes it into the retry and dead-letter copies idemq publishes
	// and into the outbox rows its handlers enqueue. nil means the
	// global propagator once a program has set one (otel.SetTextMapPropagator),
	// else W3C TraceContext + Baggage: traces continue across retries and the
	// outbox without any setup.
	Propagator propagation.TextMapPropagator
	// OnOutcome, when set, is called once for each delivery after its ack
	// (with coalesced acks: after its ack was handed to the ack window, which
	// sends it within 20ms).
	OnOutcome func(Event)
	// ConnectionName names the AMQP connections in the broker's UI.
	ConnectionName string
	// DialTimeout bounds each broker address's connect (TCP, TLS and the
	// AMQP handshake) before the next address is tried. Default
	// DefaultDialTimeout.
	DialTimeout time.Duration

	// Testing holds the knobs for tests only. Production code leaves it zero.
	Testing TestKnobs

	// partitionOf is the order exchange of the partitioned queue whose
	// partition Queue is ("" for none): set by New on the consumers of
	// the partitions.
	partitionOf string
}

// TestKnobs are settings for tests only, never for production: each turns
// off a guard that keeps a consumer safe, so that a test can reach a state
// the guard would prevent.
type TestKnobs struct {
	// DisableHeartbeat stops the runtime from extending leases while a
	// handler runs. Test-only, for tests of fencing: a handler slower than
	// its lease then loses its key and cannot commit.
	DisableHeartbeat bool
	// AllowShortRetention turns New's refusal of a store whose retention is
	// shorter than the retry horizon (ErrRetentionTooShort) into a warning.
	// Test-only, for tests with short retentions: in production a late
	// retry of a key already deleted would run twice.
	AllowShortRetention bool
}

// Group is group commit: one collector per
// connection forms groups of up to Size deliveries and each of the
// Config's Concurrency executors runs one group at a time, in one
// transaction with one commit (docs/consumer.md, "Group commit").
type Group struct {
	// Size is the most deliveries in one group: what is waiting when an
	// executor is free, or more with Linger. Their keys are reserved with
	// one statement, each handler runs under a savepoint of its own of the
	// shared transaction (unless Optimistic), and the group commits once.
	// A failing handler rolls back only its own effects and key; each
	// handler runs once per delivery. 1 turns group commit off: one
	// transaction per message. Default DefaultGroupSize (32);
	// DefaultBatchGroupSize for NewBatch, whose BatchHandler gets a
	// group at a time.
	Size int
	// Linger is how long a group may wait to fill once its first delivery
	// is in (while an executor is free); 0 hands over what is waiting,
	// adding no latency. While every executor is busy, groups fill anyway,
	// and so do a BatchHandler's while two of its groups execute.
	Linger time.Duration
	// Optimistic runs a group's handlers without a savepoint each, its
	// keys reserved in the group's transaction (see
	// Config.SeparateReservations) and completed with one statement; if any
	// handler fails, the group is rolled back and run again with
	// savepoints. Fewer statements per message, but a handler may run
	// twice for one delivery (its transactional writes count once): use it
	// only for handlers whose effects all go through the transaction.
	Optimistic bool
}

// WithDefaults returns a copy of c with every zero field set to its
// default: the configuration New runs. NewBatch runs the same but for a
// zero Group.Size, DefaultBatchGroupSize; Consumer.Config returns what a
// consumer of either kind runs.
func (c *Config) WithDefaults() Config { return c.withDefaults(DefaultGroupSize) }

// withDefaults fills the gaps, with groupSize as the default Group.Size
// (DefaultBatchGroupSize for NewBatch).
func (c *Config) withDefaults(groupSize int) Config {
	var out Config
	if c != nil {
		out = *c
	}
	out.Concurrency = cmp.Or(out.Concurrency, DefaultConcurrency)
	out.Group.Size = cmp.Or(out.Group.Size, groupSize)
	// Every executor's group plus the one filling, at least two deliveries
	// per executor.
	out.Prefetch = cmp.Or(out.Prefetch, max((out.Concurrency+1)*out.Group.Size, 2*out.Concurrency))
	out.HandlerTimeout = cmp.Or(out.HandlerTimeout, DefaultHandlerTimeout)
	out.ShutdownTimeout = cmp.Or(out.ShutdownTimeout, DefaultShutdownTimeout)
	out.PublishTimeout = cmp.Or(out.PublishTimeout, DefaultPublishTimeout)
	out.StoreTimeout = cmp.Or(out.StoreTimeout, DefaultStoreTimeout)
	out.MaxInFlightBytes = cmp.Or(out.MaxInFlightBytes, DefaultMaxInFlightBytes)
	out.MaxAttempts = cmp.Or(out.MaxAttempts, DefaultMaxAttempts)
	out.RetryInitial = cmp.Or(out.RetryInitial, DefaultRetryInitial)
	out.RetryMultiplier = cmp.Or(out.RetryMultiplier, DefaultRetryMultiplier)
	out.RetryMax = cmp.Or(out.RetryMax, DefaultRetryMax)
	out.DeliveryLimit = cmp.Or(out.DeliveryLimit, DefaultDeliveryLimit)
	out.KeyHeader = cmp.Or(out.KeyHeader, DefaultKeyHeader)
	out.TenantHeader = cmp.Or(out.TenantHeader, DefaultTenantHeader)
	out.ConnectionName = cmp.Or(out.ConnectionName, "idemq-"+out.Name)
	out.DialTimeout = cmp.Or(out.DialTimeout, DefaultDialTimeout)
	if out.Fingerprint == nil {
		out.Fingerprint = dedup.BodyFingerprint
	}
	if out.Logger == nil {
		out.Logger = slog.Default()
	}
	if out.Ordering != nil {
		o := *out.Ordering
		o.GapTimeout = cmp.Or(o.GapTimeout, DefaultGapTimeout)
		o.MaxWaiting = cmp.Or(o.MaxWaiting, max(out.Prefetch/2, 1))
		out.Ordering = &o
	}
	// Steps need leases the steps' transactions can see.
	out.SeparateReservations = out.SeparateReservations || out.Steps
	return out
}

// TopologyConfig returns the topology settings of c, defaults filled: the
// topology the consumer declares on connect, which Apply and `idemq topology
// apply` declare ahead of it. Apply connects as the consumer does (its
// AMQPConfig and ConnectionName).
func (c *Config) TopologyConfig() TopologyConfig {
	d := c.WithDefaults()
	return d.topologyConfig()
}

// topologyConfig is the topology of c, whose defaults are filled already.
func (c *Config) topologyConfig() TopologyConfig {
	d := c
	return TopologyConfig{
		Queue:           d.Queue,
		MaxAttempts:     d.MaxAttempts,
		RetryInitial:    d.RetryInitial,
		RetryMultiplier: d.RetryMultiplier,
		RetryMax:        d.RetryMax,
		DeliveryLimit:   d.DeliveryLimit,
		ClassicQueues:   d.ClassicQueues,
		Bindings:        d.Bindings,
		AMQPConfig:      d.AMQPConfig,
		ConnectionName:  d.ConnectionName,
		DialTimeout:     d.DialTimeout,

		QuorumInitialGroupSize: d.QuorumInitialGroupSize,
		Partitions:             d.Partitions,
		partitionOf:            d.partitionOf,
	}.WithDefaults()
}

// validate checks c, whose defaults are filled, and tc, its topology.
func (c Config) validate(tc TopologyConfig) error {
	var errs []error
	if o := c.Ordering; o != nil {
		if o.GapTimeout < 0 || o.GapTimeout > MaxGapTimeout {
			errs = append(errs, fmt.Errorf("ordering gap timeout %s must be between 0 and %s (the broker's consumer timeout is 30m by default)", o.GapTimeout, MaxGapTimeout))
		}
		if o.MaxWaiting < 1 || o.MaxWaiting >= c.Prefetch {
			errs = append(errs, fmt.Errorf("ordering max waiting %d must be at least 1 and below the prefetch %d (waiting messages hold prefetch slots)", o.MaxWaiting, c.Prefetch))
		}
	}
	if c.URL == "" {
		errs = append(errs, errors.New("broker URL is required"))
	}
	if c.DialTimeout < 0 {
		errs = append(errs, fmt.Errorf("dial timeout %s must not be negative", c.DialTimeout))
	}
	if c.Name == "" {
		errs = append(errs, errors.New("consumer name (the stable scope of its keys) is required"))
	}
	if c.Group.Size < 1 {
		errs = append(errs, fmt.Errorf("group size %d must be positive", c.Group.Size))
	}
	if c.Group.Linger < 0 {
		errs = append(errs, fmt.Errorf("group linger %s must not be negative", c.Group.Linger))
	}
	if c.Concurrency < 1 || c.Prefetch < 1 {
		errs = append(errs, fmt.Errorf("concurrency %d and prefetch %d must be positive", c.Concurrency, c.Prefetch))
	}
	if _, err := newIdentifier(&c); err != nil {
		errs = append(errs, err)
	}
	if c.HeaderKeys != nil {
		if err := configuredKeys(c.HeaderKeys).Validate(); err != nil {
			errs = append(errs, err)
		}
	}
	if c.StoreTimeout < 0 {
		errs = append(errs, fmt.Errorf("store timeout %s must not be negative", c.StoreTimeout))
	}
	if c.MaxInFlightBytes < 0 {
		errs = append(errs, fmt.Errorf("max in-flight bytes %d must not be negative", c.MaxInFlightBytes))
	}
	// The queue, attempts and retry settings: as the topology checks them.
	errs = append(errs, tc.Validate())
	return errors.Join(errs...)
}
