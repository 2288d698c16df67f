package cli

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/idemq/idemq/cmd/idemq/internal/forward"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/outbox"
)

// metricsFlag registers --metrics-addr and --allow-host.
func (a *app) metricsFlag(f *pflag.FlagSet, m *metricsServer) {
	f.StringSliceVar(&m.allowHosts, "allow-host", nil, "a host name the metrics server answers to beyond its address and localhost, e.g. worker.internal or *.svc.cluster.local (repeatable; requests naming another host get 421)")
	f.StringVar(&m.addr, "metrics-addr", "", "host:port where Prometheus metrics (/metrics) and a readiness check (/healthz: a forwarder answers 503 until it consumes and while it reconnects) are served, e.g. :9090 (default: none)")
}

func (a *app) forwardCommand() *cobra.Command {
	var (
		t               topologyFlags
		name            string
		toExchange      string
		toRoutingKey    string
		concurrency     int
		groupSize       int
		groupLinger     time.Duration
		relayBatch      int
		lease           time.Duration
		shutdownTimeout time.Duration
		drainTimeout    time.Duration
		hashKeys        bool
		ordered         bool
		gapTimeout      time.Duration
		tenantHeader    string
		keyHeader       string
		keyFrom         string
		headerKeysFile  string
		metrics         metricsServer
	)
	cmd := &cobra.Command{
		Use:   "forward --queue Q --consumer NAME --to-exchange X",
		Short: "Run a deduplicating stage from queue Q to exchange X",
		Long: `Consume work queue Q, claim each message's idempotency key (message_id, else the
Idempotency-Key header) in Postgres under the scope --consumer, and write the
message into the outbox in the transaction that completes the key; an outbox
relay in the same process publishes it to exchange X with publisher confirms.

Every unique key reaches X. With no crash, exactly once, whatever the
duplicates; a relay killed between the broker's confirm and its commit may
publish a row again, always with the same message_id. Duplicates are acked
without being forwarded. Missing, invalid and reused keys go to Q.dlq with
x-idemq-reason. Several forwarders may run side by side on one queue.

The forwarded message keeps the body, content type, message_id (the delivery's,
or its key), correlation_id, reply_to and all headers except idemq's own
x-idemq-* headers, the broker's x-death/x-first-death-*/x-last-death-*/
x-delivery-count, and traceparent/tracestate (replaced by the relay's span).
Its routing key is --to-routing-key, else the routing key it was first
published with (for a retried message, as idemq's signed headers record it;
x-idemq-* headers a publisher wrote are ignored). Those headers are signed
with the key 'idemq migrate' created in the schema, or with the keys of
--header-keys-file.

The consumer declares Q's topology on connect, so the topology flags must match
those given to 'idemq topology apply'. The schema must be migrated
('idemq migrate'). Runs until SIGINT or SIGTERM, then stops consuming, lets the
messages in hand finish (--shutdown-timeout), flushes the outbox (bounded by
--drain-timeout) and exits 0.

--partitions N consumes the partitions Q.p0 … Q.p{N-1} of a partitioned Q
('idemq topology apply --partitions N'); with --ordered, each ordering key's
messages are forwarded one at a time and, with x-sequence, each sequence once
and in order: a sequence that comes early waits up to --gap-timeout for its
predecessor, then goes to its partition's DLQ with reason sequence_gap and its
key is blocked ('idemq order status', 'idemq order skip'). x-ordering-key and
x-sequence are forwarded as they are (docs/ordering.md).

--key-from PRESET reads the key as a framework writes it (docs/interop.md):
message-id (the default: message_id, else --key-header), masstransit
(MT-OriginalMessageId, else message_id, else the envelope's messageId; the
fingerprint over the envelope's message), nservicebus (NServiceBus.MessageId,
else message_id), wolverine (message_id: its envelope id) or cloudevents
(the event's source and id, from a structured body or binary-mode headers; the
fingerprint over its data).`,
		Example: `  idemq forward --queue payments --consumer charge --to-exchange ledger
  idemq forward --queue ledger --partitions 4 --ordered --consumer project --to-exchange projections
  idemq forward --queue payments --consumer charge --to-exchange ledger --to-routing-key charged --concurrency 16
  idemq forward --queue orders --consumer accept --to-exchange accepted --key-from masstransit`,
		Args: noArgs,
		RunE: run(func(cmd *cobra.Command, _ []string) error {
			if err := t.validate(); err != nil {
				return err
			}
			if err := nonEmpty(cmd.Flags(), "consumer"); err != nil {
				return err
			}
			if err := a.checkURLs(); err != nil {
				return err
			}
			switch {
			case concurrency < 1:
				return usagef("--concurrency %d must be at least 1", concurrency)
			case groupSize < 1 || groupLinger < 0:
				return usagef("--group-size %d must be at least 1 and --group-linger %s not negative", groupSize, groupLinger)
			case relayBatch < 1 || relayBatch > 10000:
				return usagef("--relay-batch-size %d: want 1 to 10000", relayBatch)
			case lease != 0 && lease < time.Second:
				return usagef("--lease %s must be at least 1s", lease)
			case toExchange == "" && (toRoutingKey == "" || toRoutingKey == t.queue):
				// The default exchange routes by queue name: without another
				// routing key, every message would come back to Q.
				return usagef("--to-exchange \"\" (the default exchange) needs --to-routing-key naming another queue than --queue")
			case shutdownTimeout <= 0 || drainTimeout <= 0:
				return usagef("--shutdown-timeout and --drain-timeout must be positive")
			case gapTimeout <= 0 || gapTimeout > consumer.MaxGapTimeout:
				return usagef("--gap-timeout %s must be positive and at most %s", gapTimeout, consumer.MaxGapTimeout)
			}
			preset, err := consumer.ParseKeyPreset(keyFrom)
			if err != nil {
				return usagef("--key-from: %v", err)
			}
			headerKeys, err := a.headerKeys(headerKeysFile)
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			// A handler's transaction and a reservation per worker at
			// most, plus one per relay lane (a lane holds one during its batch).
			store, err := a.openLeaseStore(ctx, int32(2*concurrency+outbox.DefaultLanes), lease, hashKeys, toExchange)
			if err != nil {
				return err
			}
			defer store.Pool().Close()
			// /healthz answers 503 until the stage consumes, and while it
			// reconnects.
			var stage atomic.Pointer[forward.Stage]
			ready := func() error {
				if s := stage.Load(); s != nil {
					return s.Ready()
				}
				return consumer.ErrNotReady
			}
			if err := a.startTelemetryOn(ctx, metrics, ready); err != nil {
				return err
			}
			ccfg := consumer.Config{
				URL:             a.amqpURL,
				Name:            name,
				Concurrency:     concurrency,
				Group:           consumer.Group{Size: groupSize, Linger: groupLinger},
				ShutdownTimeout: shutdownTimeout,
				TenantHeader:    tenantHeader,
				KeyHeader:       keyHeader,
				KeyFrom:         preset,
				HeaderKeys:      headerKeys,
				Logger:          a.log,
				ConnectionName:  "idemq-forward-" + name,
				// The stage forwards; the requester's reply comes from downstream.
				NoReply: true,
			}
			ccfg.DialTimeout = a.connectTimeout
			t.apply(&ccfg)
			if ordered {
				ccfg.Ordering = &consumer.Ordering{GapTimeout: gapTimeout}
			}
			direct, err := a.directConfig()
			if err != nil {
				return err
			}
			st, err := forward.New(store, forward.Config{
				Consumer:     ccfg,
				Exchange:     toExchange,
				RoutingKey:   toRoutingKey,
				Relay:        outbox.RelayConfig{ConnectionName: "idemq-forward-" + name + "-relay", BatchSize: relayBatch, ListenConfig: direct},
				DrainTimeout: drainTimeout,
			})
			if err != nil {
				return err
			}
			stage.Store(st)
			return st.Run(ctx)
		}),
	}
	f := cmd.Flags()
	t.register(f)
	f.StringVar(&name, "consumer", "", "stable name of this stage (its consumer.Config.Name): keys are unique per (consumer, tenant, key) (required)")
	f.StringVar(&toExchange, "to-exchange", "", "exchange the messages are forwarded to; \"\" is the default exchange (required)")
	f.StringVar(&toRoutingKey, "to-routing-key", "", "routing key of the forwarded messages (default: the one each message was first published with)")
	f.IntVar(&concurrency, "concurrency", consumer.DefaultConcurrency, "messages handled at once")
	f.IntVar(&groupSize, "group-size", forward.DefaultGroupSize, "group commit: handle up to this many waiting messages in one transaction (their outbox rows in one COPY); 1 for one transaction per message")
	f.IntVar(&relayBatch, "relay-batch-size", forward.DefaultRelayBatchSize, "the most outbox rows the relay publishes and confirms together")
	f.DurationVar(&groupLinger, "group-linger", 0, "how long a worker waits for a group to fill (0: take only what is waiting)")
	f.DurationVar(&lease, "lease", dedup.DefaultLease, "lease of a claimed key: a crashed forwarder's keys are taken over after it")
	f.DurationVar(&shutdownTimeout, "shutdown-timeout", consumer.DefaultShutdownTimeout, "how long the messages in hand may take to finish after a signal")
	f.DurationVar(&drainTimeout, "drain-timeout", forward.DefaultDrainTimeout, "how long the relay keeps publishing the outbox after the consumer stopped")
	f.BoolVar(&ordered, "ordered", false, "keep each x-ordering-key's messages in order: one at a time, and with x-sequence each sequence once and in order (docs/ordering.md)")
	f.DurationVar(&gapTimeout, "gap-timeout", consumer.DefaultGapTimeout, "with --ordered: how long a message waits for its predecessor before it goes to the DLQ with reason sequence_gap")
	f.BoolVar(&hashKeys, "hash-keys", false, "store a SHA-256 of each key instead of the key (use 'keys inspect --hashed' to read them)")
	f.StringVar(&tenantHeader, "tenant-header", consumer.DefaultTenantHeader, "header carrying the tenant of the key")
	f.StringVar(&keyHeader, "key-header", consumer.DefaultKeyHeader, "header carrying the key of a message without message_id")
	f.StringVar(&keyFrom, "key-from", string(consumer.KeyFromMessageID), "where the key comes from: message-id, masstransit, nservicebus, wolverine or cloudevents (docs/interop.md)")
	headerKeysFlag(f, &headerKeysFile)
	a.metricsFlag(f, &metrics)
	requireFlags(cmd, "queue", "consumer", "to-exchange")
	return cmd
}

// openLeaseStore opens the key store of a long-running command that holds
// leases (forward, gateway): Postgres with at most maxConns connections, the
// schema checked, and RabbitMQ checked (see checkBroker) for its target
// exchange. The caller closes the store's pool.
func (a *app) openLeaseStore(ctx context.Context, maxConns int32, lease time.Duration, hashKeys bool, exchange string) (*dedup.Store, error) {
	pool, err := a.openStorePool(ctx, maxConns)
	if err != nil {
		return nil, err
	}
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: a.schema, Lease: lease, HashKeys: hashKeys})
	if err == nil {
		err = a.checkBroker(exchange)
	}
	if err != nil {
		pool.Close()
		return nil, err
	}
	return store, nil
}

// openStorePool opens Postgres and checks that the schema is migrated.
func (a *app) openStorePool(ctx context.Context, maxConns int32) (*pgxpool.Pool, error) {
	pool, err := a.openPostgres(ctx, maxConns)
	if err != nil {
		return nil, err
	}
	if err := a.requireSchema(ctx, pool); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// checkBroker fails fast when RabbitMQ is out of reach at start (later, the
// consumer and the relay reconnect by themselves), and warns when the target
// exchange does not exist: its messages then wait in the outbox.
func (a *app) checkBroker(exchange string) error {
	conn, err := a.dialAMQP("idemq-preflight")
	if err != nil {
		return err
	}
	defer conn.Close()
	if exchange == "" {
		return nil
	}
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	defer ch.Close()
	err = ch.ExchangeDeclarePassive(exchange, amqp.ExchangeDirect, true, false, false, false, nil)
	var ae *amqp.Error
	if errors.As(err, &ae) && ae.Code == amqp.NotFound {
		a.log.Warn("the target exchange does not exist: messages wait in the outbox until it does (and are parked after repeated failures)", "exchange", exchange)
	}
	return nil
}

func (a *app) relayCommand() *cobra.Command {
	var (
		batch   int
		poll    time.Duration
		metrics metricsServer
	)
	cmd := &cobra.Command{
		Use:   "relay",
		Short: "Run the outbox relay alone",
		Long: `Publish the rows of the outbox (in --schema) to RabbitMQ with publisher
confirms and mandatory routing, marking each row published only after its
confirm. Woken by LISTEN/NOTIFY, with a poll as fallback. Several relays (and
forwarders, which run one each) may run side by side: each claims its own rows.
Unroutable messages are retried with backoff and parked after repeated returns,
never dropped. Runs until SIGINT or SIGTERM, then finishes its batch and exits 0.`,
		Example: `  idemq relay
  idemq relay --schema payments_idemq --batch 500`,
		Args: noArgs,
		RunE: run(func(cmd *cobra.Command, _ []string) error {
			if batch < 1 || batch > 10000 {
				return usagef("--batch %d: want 1 to 10000", batch)
			}
			if poll <= 0 {
				return usagef("--poll-interval %s must be positive", poll)
			}
			if err := a.checkURLs(); err != nil {
				return err
			}
			ctx := cmd.Context()
			// One connection per lane; the LISTEN has its own.
			pool, err := a.openStorePool(ctx, int32(outbox.DefaultLanes))
			if err != nil {
				return err
			}
			defer pool.Close()
			if err := a.checkBroker(""); err != nil {
				return err
			}
			if err := a.startTelemetryOn(ctx, metrics, nil); err != nil {
				return err
			}
			ob, err := outbox.New(pool, &outbox.Config{Schema: a.schema})
			if err != nil {
				return err
			}
			direct, err := a.directConfig()
			if err != nil {
				return err
			}
			r, err := outbox.NewRelay(ob, a.amqpURL, &outbox.RelayConfig{
				BatchSize:    batch,
				PollInterval: poll,
				ListenConfig: direct,
				Logger:       a.log,
			})
			if err != nil {
				return err
			}
			a.log.Info("relaying", "schema", a.schema)
			return r.Run(ctx)
		}),
	}
	cmd.Flags().IntVar(&batch, "batch", outbox.DefaultBatchSize, "rows claimed, published and confirmed together")
	cmd.Flags().DurationVar(&poll, "poll-interval", outbox.DefaultPollInterval, "how often to look for rows when no notification comes")
	a.metricsFlag(cmd.Flags(), &metrics)
	return cmd
}
