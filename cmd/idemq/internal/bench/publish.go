package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/idemq/idemq/cmd/idemq/internal/forward"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/amqpdial"
	"github.com/idemq/idemq/outbox"
)

// The publishing side: what the outbox costs against publishing directly.
//
//   - the relay drains a preloaded outbox (rows written with EnqueueBatch,
//     one COPY per 5,000) into a plain durable queue, against a bare
//     publisher with confirms (window 1000) into the same queue kind;
//   - the forwarding stage of `idemq forward` (consume, claim, outbox row in
//     the completion's transaction, relay, publish) against a bare pipe
//     (consume, publish with confirm, ack after the confirm).

// publishWindow is the bare publisher's most outstanding confirms.
const publishWindow = 1000

func publishScenarios() []scenario {
	var out []scenario
	for _, classic := range []bool{false, true} {
		kind := "quorum"
		if classic {
			kind = "classic"
		}
		out = append(out,
			scenario{name: fmt.Sprintf("bare publish+confirms (window %d), %s", publishWindow, kind), mode: modePublish, classic: classic, group: kind, bare: true},
			scenario{name: "idemq relay batch 100, " + kind, mode: modeRelay, classic: classic, batch: 100, group: kind},
			scenario{name: "idemq relay batch 500, " + kind, mode: modeRelay, classic: classic, batch: 500, group: kind},
			scenario{name: "bare publish+confirms, " + kind + ", again", mode: modePublish, classic: classic, group: kind, bare: true},
		)
	}
	return append(out,
		scenario{name: "bare pipe: consume, publish+confirm, ack", mode: modePipe, group: "forward", bare: true},
		scenario{name: "idemq forward: claim, outbox, relay", mode: modeForward, group: "forward"},
		scenario{name: "bare pipe, again", mode: modePipe, group: "forward", bare: true},
	)
}

// declarePlain gives a fresh durable queue of the kind asked for.
func declarePlain(conn *amqp.Connection, queue string, classic bool) error {
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	if _, err := ch.QueueDelete(queue, false, false, false); err != nil {
		return err
	}
	args := amqp.Table{"x-queue-type": "quorum"}
	if classic {
		args = amqp.Table{"x-queue-type": "classic"}
	}
	_, err = ch.QueueDeclare(queue, true, false, false, false, args)
	return err
}

func deleteQueue(conn *amqp.Connection, queue string) {
	if ch, err := conn.Channel(); err == nil {
		_, _ = ch.QueueDelete(queue, false, false, false)
		_ = ch.Close()
	}
}

// preloadOutbox writes n rows to the outbox, to the default exchange with
// queue as routing key, 5,000 per transaction (one COPY each).
func preloadOutbox(ctx context.Context, pool *pgxpool.Pool, queue string, n, size int) error {
	ob, err := outbox.New(pool, &outbox.Config{Schema: benchSchema})
	if err != nil {
		return err
	}
	body := bytes.Repeat([]byte("x"), size)
	const chunk = 5000
	msgs := make([]outbox.Message, 0, chunk)
	for i := 0; i < n; i += chunk {
		msgs = msgs[:0]
		for j := i; j < min(n, i+chunk); j++ {
			msgs = append(msgs, outbox.Message{RoutingKey: queue, Body: body, MessageID: "o-" + strconv.Itoa(j)})
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return ob.EnqueueBatch(ctx, tx, msgs) }); err != nil {
			return err
		}
	}
	// What autovacuum would do to a table that big, before the relay plans
	// its claims on it.
	_, err = pool.Exec(ctx, "ANALYZE "+pgx.Identifier{benchSchema, "outbox"}.Sanitize())
	return err
}

// runPublishScenario runs one row of the publishing table.
func (b *bench) runPublishScenario(ctx context.Context, sc scenario, measure func() measured) (Result, error) {
	o := b.o
	stamp := time.Now().UnixNano()
	spec := workerSpec{Mode: sc.mode, PostgresURL: o.PostgresURL, AMQPURL: o.AMQPURL, Schema: benchSchema,
		Count: o.Messages, MaxDuration: o.MaxDuration, Concurrency: o.Concurrency, Prefetch: o.Prefetch,
		BodySize: o.BodySize, Window: publishWindow, BatchSize: sc.batch}
	switch sc.mode {
	case modePublish, modeRelay:
		spec.Target = fmt.Sprintf("idemq.bench.pub.%d", stamp)
		if err := declarePlain(b.conn, spec.Target, sc.classic); err != nil {
			return Result{}, err
		}
		defer deleteQueue(b.conn, spec.Target)
		if err := resetSchema(ctx, b.pool); err != nil {
			return Result{}, err
		}
		if sc.mode == modeRelay {
			if err := preloadOutbox(ctx, b.pool, spec.Target, o.Messages, o.BodySize); err != nil {
				return Result{}, err
			}
		}
	case modePipe, modeForward:
		spec.Queue = fmt.Sprintf("idemq.bench.fwd.%d", stamp)
		spec.Target = spec.Queue + ".out"
		if err := prepare(ctx, b.pool, b.conn, spec.Queue, 0); err != nil {
			return Result{}, err
		}
		defer cleanupQueue(b.conn, spec.Queue, 0)
		if err := declarePlain(b.conn, spec.Target, false); err != nil {
			return Result{}, err
		}
		defer deleteQueue(b.conn, spec.Target)
		if err := publish(ctx, b.conn, spec.Queue, o.Messages, o.BodySize, 0, "f-", 0, 0); err != nil {
			return Result{}, err
		}
	}
	quiesce(ctx, b.pool)
	m := measure()
	res, usage, err := runWorkerProcess(ctx, spec)
	if err != nil {
		return Result{}, err
	}
	var r Result
	m.done(&r, res, usage)
	r.Note = res.Note
	if err := b.checkDelivered(spec.Target, o.Messages); err != nil && r.Note == "" {
		r.Note = err.Error()
	}
	return r, nil
}

// checkDelivered checks that queue holds n messages: every one published
// arrived, once.
func (b *bench) checkDelivered(queue string, n int) error {
	ch, err := b.conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return err
	}
	if q.Messages != n {
		return fmt.Errorf("%d messages in %s, want %d", q.Messages, queue, n)
	}
	return nil
}

// runPublisher publishes Count persistent, mandatory messages to Target
// with confirms, at most Window outstanding.
func runPublisher(ctx context.Context, spec workerSpec) (workerResult, error) {
	t := newTally(spec.Count)
	t.start()
	conn, ch, err := confirmChannel(ctx, spec.AMQPURL, "idemq-bench")
	if err != nil {
		return workerResult{}, err
	}
	defer conn.Close()
	body := bytes.Repeat([]byte("x"), spec.BodySize)
	window := make(chan *amqp.DeferredConfirmation, max(1, spec.Window-1))
	failed := make(chan error, 1)
	go func() {
		for c := range window {
			if ok, err := c.WaitContext(ctx); err != nil || !ok {
				failed <- fmt.Errorf("publish not confirmed (ack %v): %v", ok, err)
				return
			}
			t.settleN(1)
		}
	}()
	for i := range spec.Count {
		c, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", spec.Target, true, false,
			amqp.Publishing{MessageId: "b-" + strconv.Itoa(i), Body: body, DeliveryMode: amqp.Persistent})
		if err != nil {
			return t.result(), err
		}
		select {
		case window <- c:
		case err := <-failed:
			return t.result(), err
		}
	}
	close(window)
	select {
	case <-t.done:
	case err := <-failed:
		return t.result(), err
	case <-time.After(spec.MaxDuration):
	}
	return t.result(), nil
}

// publishedMeter is a MeterProvider that counts the relay's
// idemq.outbox.published counter (docs/outbox.md), which the relay adds to
// after the commit that marks the rows published, and is a no-op otherwise:
// it registers no gauge, so nothing queries the backlog during the row.
type publishedMeter struct {
	noop.MeterProvider
	add func(int64)
}

func (p publishedMeter) Meter(string, ...metric.MeterOption) metric.Meter {
	return countingMeter{add: p.add}
}

type countingMeter struct {
	noop.Meter
	add func(int64)
}

func (m countingMeter) Int64Counter(name string, _ ...metric.Int64CounterOption) (metric.Int64Counter, error) {
	if name == "idemq.outbox.published" {
		return countingCounter{add: m.add}, nil
	}
	return noop.Int64Counter{}, nil
}

type countingCounter struct {
	noop.Int64Counter
	add func(int64)
}

func (c countingCounter) Add(_ context.Context, n int64, _ ...metric.AddOption) { c.add(n) }

func discardLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// runRelay runs an outbox relay on the preloaded outbox until Count rows
// are published and marked.
func runRelay(ctx context.Context, spec workerSpec) (workerResult, error) {
	t := newTally(spec.Count)
	t.start()
	pcfg, err := pgxpool.ParseConfig(spec.PostgresURL)
	if err != nil {
		return workerResult{}, err
	}
	pcfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return workerResult{}, err
	}
	defer pool.Close()
	ob, err := outbox.New(pool, &outbox.Config{Schema: spec.Schema})
	if err != nil {
		return workerResult{}, err
	}
	// IDEMQ_BENCH_RELAY_LANES sets RelayConfig.Lanes (default: the relay's).
	lanes, _ := strconv.Atoi(os.Getenv("IDEMQ_BENCH_RELAY_LANES"))
	r, err := outbox.NewRelay(ob, spec.AMQPURL, &outbox.RelayConfig{
		BatchSize: spec.BatchSize, Lanes: lanes, ConnectionName: "idemq-bench-relay",
		Logger: discardLogger(), MeterProvider: publishedMeter{add: t.settleN},
	})
	if err != nil {
		return workerResult{}, err
	}
	return runUntilCounted(ctx, t, spec.MaxDuration, r.Run)
}

// runUntilCounted runs fn until t has its count (or the time is up), then
// stops it and waits for it to return.
func runUntilCounted(ctx context.Context, t *tally, limit time.Duration, fn func(context.Context) error) (workerResult, error) {
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- fn(runCtx) }()
	select {
	case <-t.done:
	case <-time.After(limit):
	case err := <-done:
		stop()
		return t.result(), fmt.Errorf("stopped before %d messages (%d): %v", t.count, t.settled.Load(), err)
	}
	res := t.result()
	stop()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		return res, err
	}
	return res, nil
}

// runPipe consumes Queue and publishes each message to Target with a
// confirm; a delivery is acked after its copy's confirm.
func runPipe(ctx context.Context, spec workerSpec) (workerResult, error) {
	t := newTally(spec.Count)
	t.start()
	// Two connections, as the forwarder has: a publisher under flow control
	// does not hold up the consumer's acks.
	in, err := amqpdial.DialURL(ctx, spec.AMQPURL, "idemq-bench", 0)
	if err != nil {
		return workerResult{}, err
	}
	defer in.Close()
	out, err := amqpdial.DialURL(ctx, spec.AMQPURL, "idemq-bench", 0)
	if err != nil {
		return workerResult{}, err
	}
	defer out.Close()
	cch, err := in.Channel()
	if err != nil {
		return workerResult{}, err
	}
	if err := cch.Qos(spec.Prefetch, 0, false); err != nil {
		return workerResult{}, err
	}
	pch, err := out.Channel()
	if err != nil {
		return workerResult{}, err
	}
	if err := pch.Confirm(false); err != nil {
		return workerResult{}, err
	}
	returns := pch.NotifyReturn(make(chan amqp.Return, 16))
	go func() {
		for range returns {
		}
	}()
	ds, err := cch.Consume(spec.Queue, "", false, false, false, false, nil)
	if err != nil {
		return workerResult{}, err
	}
	type inFlight struct {
		c *amqp.DeferredConfirmation
		d amqp.Delivery
	}
	pending := make(chan inFlight, spec.Prefetch)
	failed := make(chan error, 1)
	go func() {
		for p := range pending {
			if ok, err := p.c.WaitContext(ctx); err != nil || !ok {
				failed <- fmt.Errorf("copy not confirmed (ack %v): %v", ok, err)
				return
			}
			if err := p.d.Ack(false); err != nil {
				failed <- err
				return
			}
			t.settleN(1)
		}
	}()
	go func() {
		defer close(pending)
		n := 0
		for d := range ds {
			c, err := pch.PublishWithDeferredConfirmWithContext(ctx, "", spec.Target, true, false, amqp.Publishing{
				MessageId: d.MessageId, Headers: d.Headers, ContentType: d.ContentType, Body: d.Body, DeliveryMode: amqp.Persistent,
			})
			if err != nil {
				failed <- err
				return
			}
			pending <- inFlight{c, d}
			if n++; n == spec.Count {
				return
			}
		}
	}()
	select {
	case <-t.done:
	case err := <-failed:
		return t.result(), err
	case <-time.After(spec.MaxDuration):
	}
	return t.result(), nil
}

// runForward runs the stage of `idemq forward` (internal/forward) from
// Queue to Target, with the consumer's defaults there but the bench's
// concurrency and prefetch, until Count messages are published by its relay.
func runForward(ctx context.Context, spec workerSpec) (workerResult, error) {
	t := newTally(spec.Count)
	t.start()
	// Sized as `idemq forward` sizes its pool.
	store, closePool, err := openStore(ctx, spec, 2*spec.Concurrency+outbox.DefaultLanes)
	if err != nil {
		return workerResult{}, err
	}
	defer closePool()
	stage, err := forward.New(store, forward.Config{
		Consumer: consumer.Config{
			URL: spec.AMQPURL, Queue: spec.Queue, Name: "bench", SkipDeclare: true,
			Concurrency: spec.Concurrency, Prefetch: spec.Prefetch, NoReply: true,
			Logger: discardLogger(), ConnectionName: "idemq-bench-forward",
		},
		RoutingKey: spec.Target,
		Relay:      outbox.RelayConfig{ConnectionName: "idemq-bench-forward-relay", MeterProvider: publishedMeter{add: t.settleN}},
	})
	if err != nil {
		return workerResult{}, err
	}
	return runUntilCounted(ctx, t, spec.MaxDuration, stage.Run)
}

// confirmChannel dials url as name and opens a channel in confirm mode
// whose returned messages are read and dropped (the publishers count what
// was confirmed); closing the connection closes both.
func confirmChannel(ctx context.Context, url, name string) (*amqp.Connection, *amqp.Channel, error) {
	conn, err := amqpdial.DialURL(ctx, url, name, 0)
	if err != nil {
		return nil, nil, err
	}
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Confirm(false)
	}
	if err != nil {
		_ = conn.Close()
		return nil, nil, err
	}
	returns := ch.NotifyReturn(make(chan amqp.Return, 16))
	go func() {
		for range returns {
		}
	}()
	return conn, ch, nil
}
