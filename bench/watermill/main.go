// Command watermill is the peer consumer of the idemq benchmark: the same
// workload (an existing quorum queue preloaded with N messages, the key in
// the AMQP message_id) consumed by a Watermill router over watermill-amqp,
// with Watermill's Deduplicator middleware keyed by message_id.
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
	amqp "github.com/rabbitmq/amqp091-go"
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
	flag.Parse()
	if *queue == "" || *count <= 0 || *prefetch < 0 || *concurrency < 1 {
		fmt.Fprintln(os.Stderr, "usage: watermill --queue Q --count N [--amqp-url URL] [--prefetch P] [--concurrency C]")
		os.Exit(2)
	}
	res, err := run(*url, *queue, *count, *prefetch, *concurrency, *window, *maxDuration)
	if err != nil {
		fmt.Fprintln(os.Stderr, "watermill:", err)
		os.Exit(1)
	}
	out, _ := json.Marshal(res)
	fmt.Println(string(out))
}

func run(url, queue string, count int64, prefetch, concurrency int, window, maxDuration time.Duration) (result, error) {
	start := time.Now()
	logger := errorLogger{}

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

	repo, err := middleware.NewMapExpiringKeyRepository(window)
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
	for i := range concurrency {
		router.AddConsumerHandler(fmt.Sprintf("bench-%d", i), queue, sub, handler)
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
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
