// Command watermill is the peer consumer of the idemq benchmark: the same
// workload (an existing quorum queue preloaded with N messages, the key in
// the AMQP message_id) consumed by a Watermill router over watermill-amqp,
// with Watermill's Deduplicator middleware keyed by message_id.
//
// --dedup memory (the default) is Watermill's own in-memory repository;
// --dedup postgres is a durable one (pgKeyRepository, below) on Postgres
// through watermill-sql's pgx adapter. --effect ledger makes the handler
// insert one ledger row per message, as idemq's bench handlers do.
//
// It stops once N deliveries have been acknowledged (unique ones handled and
// duplicates dropped by the Deduplicator alike) and prints one JSON line:
//
//	{"handled":..,"deduplicated":..,"elapsed_ns":..,"first_to_last_ns":..}
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
)

// keyMetadata is the metadata field the marshaler copies the AMQP
// message_id into; the Deduplicator reads its key from it.
const keyMetadata = "amqp_message_id"

type result struct {
	Handled      int64 `json:"handled"`
	Deduplicated int64 `json:"deduplicated"`
	ElapsedNs    int64 `json:"elapsed_ns"`
	FirstToLast  int64 `json:"first_to_last_ns"`
}

func main() {
	url := flag.String("amqp-url", "amqp://guest:guest@127.0.0.1:5672/", "AMQP URL")
	queue := flag.String("queue", "", "existing (quorum) queue to consume; it is never declared, only checked passively")
	count := flag.Int64("count", 0, "stop after this many deliveries were acked (handled + deduplicated)")
	prefetch := flag.Int("prefetch", 32, "basic.qos prefetch count, per consumer channel")
	concurrency := flag.Int("concurrency", 1, "consumers on the queue (one router handler, AMQP channel and consumer each)")
	window := flag.Duration("window", time.Minute, "Deduplicator retention window (Watermill's default is one minute)")
	maxDuration := flag.Duration("max-duration", 10*time.Minute, "give up (exit 1) if --count is not reached in this time")
	dedupKind := flag.String("dedup", "memory", "Deduplicator repository: memory (Watermill's map) or postgres (durable, pgKeyRepository)")
	effect := flag.String("effect", "none", "what the handler does: none, or ledger (one INSERT per message, autocommit)")
	pgURL := flag.String("postgres-url", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable", "Postgres URL (--dedup postgres, --effect ledger)")
	schema := flag.String("schema", "idemq_bench", "existing schema of the key table (made if missing) and of the ledger table (must exist for --effect ledger)")
	flag.Parse()
	if *queue == "" || *count <= 0 || *prefetch < 0 || *concurrency < 1 ||
		(*dedupKind != "memory" && *dedupKind != "postgres") || (*effect != "none" && *effect != "ledger") {
		fmt.Fprintln(os.Stderr, "usage: watermill --queue Q --count N [--amqp-url URL] [--prefetch P] [--concurrency C] [--dedup memory|postgres] [--effect none|ledger] [--postgres-url URL] [--schema S]")
		os.Exit(2)
	}
	o := options{dedup: *dedupKind, effect: *effect, pgURL: *pgURL, schema: *schema}
	res, err := run(*url, *queue, *count, *prefetch, *concurrency, *window, *maxDuration, o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "watermill:", err)
		os.Exit(1)
	}
	out, _ := json.Marshal(res)
	fmt.Println(string(out))
}

// options are the durable variants: where the keys live, what the handler does.
type options struct {
	dedup, effect, pgURL, schema string
}

func run(url, queue string, count int64, prefetch, concurrency int, window, maxDuration time.Duration, o options) (result, error) {
	start := time.Now()
	logger := errorLogger{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	var pool *pgxpool.Pool
	if o.dedup == "postgres" || o.effect == "ledger" {
		cfg, err := pgxpool.ParseConfig(o.pgURL)
		if err != nil {
			return result{}, err
		}
		// One connection per consumer for the key and one for the effect.
		cfg.MaxConns = int32(2*concurrency + 2)
		if pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
			return result{}, err
		}
		defer pool.Close()
	}

	cfg := wamqp.NewDurableQueueConfig(url)
	cfg.Marshaler = messageIDMarshaler{}
	cfg.Queue.GenerateName = wamqp.GenerateQueueNameConstant(queue)
	// What the queue is; only used if someone swaps the topology builder
	// back to the declaring one. passiveTopology never redeclares.
	cfg.Queue.Durable = true
	cfg.Queue.Arguments = amqp.Table{"x-queue-type": "quorum"}
	cfg.TopologyBuilder = passiveTopology{}
	cfg.Consume.Qos = wamqp.QosConfig{PrefetchCount: prefetch}

	sub, err := wamqp.NewSubscriber(cfg, logger)
	if err != nil {
		return result{}, fmt.Errorf("subscriber: %w", err)
	}
	defer sub.Close()

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return result{}, err
	}

	var repo middleware.ExpiringKeyRepository
	if o.dedup == "postgres" {
		repo, err = newPgKeyRepository(ctx, wsql.BeginnerFromPgx(pool), o.schema, window)
	} else {
		repo, err = middleware.NewMapExpiringKeyRepository(window)
	}
	if err != nil {
		return result{}, err
	}
	dedup := &middleware.Deduplicator{
		KeyFactory: middleware.NewMessageHasherFromMetadataField(keyMetadata),
		Repository: repo,
		Timeout:    time.Minute,
	}

	var (
		handled, settled atomic.Int64
		firstNs, lastNs  atomic.Int64
		done             = make(chan struct{})
		doneOnce         sync.Once
		failure          atomic.Pointer[error]
	)
	finish := func() { doneOnce.Do(func() { close(done) }) }

	// Outermost: sees every delivery, duplicates included. It acks the
	// message itself (the router's own Ack afterwards is a no-op) so the
	// N-th timestamp is taken after the ack was signalled to the subscriber.
	counter := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			firstNs.CompareAndSwap(0, time.Now().UnixNano())
			out, err := h(msg)
			if err != nil {
				failure.CompareAndSwap(nil, &err)
				finish()
				return out, err
			}
			msg.Ack()
			if settled.Add(1) == count {
				lastNs.Store(time.Now().UnixNano())
				finish()
			}
			return out, nil
		}
	}
	router.AddMiddleware(counter, dedup.Middleware)

	handler := func(msg *message.Message) error {
		handled.Add(1) // the effect: nothing
		return nil
	}
	if o.effect == "ledger" {
		ledger := pgx.Identifier{o.schema, "ledger"}.Sanitize()
		handler = func(msg *message.Message) error {
			// The effect in a transaction of its own: the Deduplicator
			// recorded the key before, outside of it.
			if _, err := pool.Exec(msg.Context(), "INSERT INTO "+ledger+" (key) VALUES ($1)", msg.UUID); err != nil {
				return err
			}
			handled.Add(1)
			return nil
		}
	}
	for i := range concurrency {
		router.AddConsumerHandler(fmt.Sprintf("bench-%d", i), queue, sub, handler)
	}

	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(ctx) }()

	select {
	case <-done:
	case err := <-runErr:
		return result{}, fmt.Errorf("router stopped before %d messages (got %d): %v", count, settled.Load(), err)
	case <-time.After(maxDuration):
		_ = router.Close()
		return result{}, fmt.Errorf("timeout: %d of %d messages after %s", settled.Load(), count, maxDuration)
	}
	end := time.Now()
	if p := failure.Load(); p != nil {
		_ = router.Close()
		return result{}, fmt.Errorf("handler: %w", *p)
	}

	// The subscriber goroutine turns the last Ack into basic.ack right away;
	// leave it a moment before closing, which nacks whatever is still in
	// flight (nothing, when the queue held exactly N messages).
	time.Sleep(100 * time.Millisecond)
	if err := router.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "watermill: close:", err)
	}
	<-runErr

	h := handled.Load()
	return result{
		Handled:      h,
		Deduplicated: settled.Load() - h,
		ElapsedNs:    end.Sub(start).Nanoseconds(),
		FirstToLast:  lastNs.Load() - firstNs.Load(),
	}, nil
}

// messageIDMarshaler maps the AMQP message_id to the Watermill message UUID
// and to the keyMetadata field. watermill-amqp's DefaultMarshaler ignores
// message_id (it reads the UUID from the "_watermill_message_uuid" header) and
// rejects non-string header values, so it cannot read this workload.
type messageIDMarshaler struct{ wamqp.DefaultMarshaler }

func (m messageIDMarshaler) Unmarshal(d amqp.Delivery) (*message.Message, error) {
	msg := message.NewMessage(d.MessageId, d.Body)
	for k, v := range d.Headers {
		if s, ok := v.(string); ok {
			msg.Metadata.Set(k, s)
		} else {
			msg.Metadata.Set(k, fmt.Sprint(v))
		}
	}
	if d.MessageId != "" {
		msg.Metadata.Set(keyMetadata, d.MessageId)
	}
	return msg, nil
}

// passiveTopology checks that the queue exists and declares nothing, so the
// caller's queue arguments (quorum type, dead lettering, limits) are never
// contradicted.
type passiveTopology struct{}

func (passiveTopology) BuildTopology(ch *amqp.Channel, p wamqp.BuildTopologyParams, _ wamqp.Config, _ watermill.LoggerAdapter) error {
	if _, err := ch.QueueDeclarePassive(p.QueueName, true, false, false, false, nil); err != nil {
		return fmt.Errorf("queue %q must exist: %w", p.QueueName, err)
	}
	return nil
}

func (passiveTopology) ExchangeDeclare(*amqp.Channel, string, wamqp.Config) error {
	return errors.New("exchanges are not declared by this program")
}

// errorLogger writes Watermill's errors to stderr and drops the rest.
type errorLogger struct{}

func (errorLogger) Error(msg string, err error, fields watermill.LogFields) {
	fmt.Fprintf(os.Stderr, "watermill: %s: %v %v\n", msg, err, fields)
}
func (errorLogger) Info(string, watermill.LogFields)                   {}
func (errorLogger) Debug(string, watermill.LogFields)                  {}
func (errorLogger) Trace(string, watermill.LogFields)                  {}
func (l errorLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }
