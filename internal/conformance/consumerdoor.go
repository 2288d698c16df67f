package conformance

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/deduptest"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/wire"
)

// Mode is one of the consumer's modes (consumer.Modes).
type Mode = consumer.Mode

// Modes are the consumer's modes: consumer.Modes.
func Modes() []Mode { return consumer.Modes() }

// The consumer doors' names.
const (
	consumerName = "conformance"
	opIDHeader   = "x-conformance-op"
	// consumerLease is the doors' lease: a dead worker's key is taken
	// over within about a second.
	consumerLease = time.Second
)

// errInfra is the infrastructure failure a Fail act returns.
var errInfra = errors.New("conformance: the card network is down")

// consumerDoor is a real consumer of a real queue, in one mode.
type consumerDoor struct {
	mode   Mode
	store  *dedup.Store
	cfg    consumer.Config
	pub    *amqp.Channel
	replyQ string

	mu      sync.Mutex
	byTrace map[string]*consumerOp
	byCorr  map[string]*consumerOp
}

// consumerOp is one operation on its way through a consumer door.
type consumerOp struct {
	p *Pending
	// final is the event that ended it; reply the reply it asked for.
	final *consumer.Event
	reply *amqp.Delivery
}

// NewConsumerDoor is the door of a consumer in mode m, over a store on a
// fresh schema of pool and a fresh queue of the test broker. Each
// operation is published with a trace of its own (its events are told
// apart by their TraceID) and a reply_to (its stored result comes back as
// the consumer's reply).
func NewConsumerDoor(pool *pgxpool.Pool, m Mode) NewDoor {
	return func(t *testing.T, handle Handle) Door {
		store := deduptest.Store(t, pool, &dedup.Config{Lease: consumerLease})
		schema := store.Config().Schema
		createEffects(t, pool, schema)
		d := &consumerDoor{mode: m, store: store, byTrace: map[string]*consumerOp{}, byCorr: map[string]*consumerOp{}}
		queue := testamqp.Name(t, "conformance")
		d.cfg = consumer.Config{
			URL:             testamqp.URL(),
			Queue:           queue,
			Name:            consumerName,
			Concurrency:     4,
			Lease:           consumerLease,
			RetryInitial:    200 * time.Millisecond,
			RetryMultiplier: 2,
			MaxAttempts:     3,
			ShutdownTimeout: 10 * time.Second,
			ConnectionName:  "idemq-test-" + queue,
			Logger:          slog.New(slog.NewTextHandler(io.Discard, nil)),
			TracerProvider:  sdktrace.NewTracerProvider(),
			OnOutcome:       d.event,
		}
		m.Apply(&d.cfg)
		topo := consumer.NewTopology(d.cfg.TopologyConfig())
		queues := []string{topo.Queue, topo.DLQ}
		for _, delay := range topo.Delays {
			queues = append(queues, topo.TierName(delay))
		}
		testamqp.DeleteQueuesAtCleanup(t, queues, []string{topo.DLX})
		if err := consumer.Apply(t.Context(), d.cfg.URL, d.cfg.TopologyConfig()); err != nil {
			t.Fatalf("apply topology: %v", err)
		}
		conn := testamqp.Dial(t)
		d.pub = testamqp.Channel(t, conn)
		d.replyQ = queue + ".replies"
		ch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ch.QueueDeclare(d.replyQ, false, true, true, false, nil); err != nil {
			t.Fatalf("declare the reply queue: %v", err)
		}
		replies, err := ch.Consume(d.replyQ, "", true, true, false, false, nil)
		if err != nil {
			t.Fatalf("consume the replies: %v", err)
		}
		go func() {
			for r := range replies {
				d.replied(r)
			}
		}()

		h := d.handler(handle, schema)
		var c *consumer.Consumer
		if m.Batch() {
			c, err = consumer.NewBatch(store, asBatch(h), &d.cfg)
		} else {
			c, err = consumer.New(store, h, &d.cfg)
		}
		if err != nil {
			t.Fatalf("new consumer: %v", err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		wg.Go(func() {
			if err := c.Run(ctx); err != nil {
				t.Errorf("run: %v", err)
			}
		})
		t.Cleanup(func() { cancel(); wg.Wait() })
		return d
	}
}

// handler is handle as a consumer.Handler.
func (d *consumerDoor) handler(handle Handle, schema string) consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, dl *consumer.Delivery) (consumer.Response, error) {
		act := handle(ctx, tx, Call{Tenant: dl.Tenant, Key: dl.Key, Attempt: dl.Attempt, Body: dl.Body, Schema: schema})
		switch act.Kind {
		case Succeed:
			return consumer.Response{Code: act.Code, Body: act.Body}, nil
		case Reject:
			return consumer.Response{}, consumer.Reject(act.Code, "insufficient funds", act.Body)
		}
		if err := ctx.Err(); err != nil {
			return consumer.Response{}, context.Cause(ctx)
		}
		return consumer.Response{}, errInfra
	}
}

// asBatch is a per-message handler as a batch handler over the same
// transaction: a failure fails the batch, which the runtime isolates.
func asBatch(h consumer.Handler) consumer.BatchHandler {
	return func(ctx context.Context, tx pgx.Tx, ds []*consumer.Delivery) ([]consumer.Response, error) {
		out := make([]consumer.Response, len(ds))
		for i, dl := range ds {
			r, err := h(ctx, tx, dl)
			if err != nil {
				return nil, err
			}
			out[i] = r
		}
		return out, nil
	}
}

func (d *consumerDoor) Features() Features { return Features{HeldReservations: !d.mode.Separate()} }

func (d *consumerDoor) Store() *dedup.Store { return d.store }

func (d *consumerDoor) Scope(tenant, key string) dedup.Scope {
	return dedup.Scope{Consumer: consumerName, Tenant: tenant, Key: key}
}

func (d *consumerDoor) Fingerprint(op Op) dedup.Fingerprint {
	fp, _ := dedup.BodyFingerprint(op.Body)
	return fp
}

// Send publishes op to the work queue: the key as message_id (in the
// Idempotency-Key header when it is longer than a message_id can be), the
// tenant in x-tenant-id.
func (d *consumerDoor) Send(tb testing.TB, op Op) *Pending {
	tb.Helper()
	traceID, corr := randomHex(16), randomHex(8)
	o := &consumerOp{p: newPending()}
	d.mu.Lock()
	d.byTrace[traceID], d.byCorr[corr] = o, o
	d.mu.Unlock()
	headers := amqp.Table{
		wire.HeaderTraceparent: "00-" + traceID + "-" + randomHex(8) + "-01",
		opIDHeader:             corr,
	}
	if op.Tenant != "" {
		headers[consumer.DefaultTenantHeader] = op.Tenant
	}
	msg := amqp.Publishing{Headers: headers, Body: op.Body, ReplyTo: d.replyQ, CorrelationId: corr, DeliveryMode: amqp.Persistent}
	if len(op.Key) <= 255 {
		msg.MessageId = op.Key
	} else {
		headers[consumer.DefaultKeyHeader] = op.Key
	}
	testamqp.Publish(tb, d.pub, "", d.cfg.Queue, msg)
	return o.p
}

// event routes a consumer's event to its operation.
func (d *consumerDoor) event(ev consumer.Event) {
	d.mu.Lock()
	defer d.mu.Unlock()
	o := d.byTrace[ev.TraceID]
	if o == nil {
		return
	}
	switch ev.Outcome {
	case consumer.OutcomeRetried, consumer.OutcomeCopyFailed:
		o.p.observe(Retried)
		return
	case consumer.OutcomeInProgress:
		o.p.observe(InProgress)
		return
	case consumer.OutcomeLeaseLost:
		o.p.observe(LeaseLost)
		return
	}
	o.final = &ev
	d.settle(o)
}

// replied routes a reply to its operation.
func (d *consumerDoor) replied(r amqp.Delivery) {
	d.mu.Lock()
	defer d.mu.Unlock()
	o := d.byCorr[r.CorrelationId]
	if o == nil || o.reply != nil {
		return
	}
	o.reply = &r
	d.settle(o)
}

// settle finishes o once its final event and, for a stored result, its
// reply are in.
func (d *consumerDoor) settle(o *consumerOp) {
	ev := o.final
	if ev == nil {
		return
	}
	var a Answer
	switch ev.Outcome {
	case consumer.OutcomeProcessed:
		a.Result = Processed
	case consumer.OutcomeRejected:
		a.Result = Rejected
	case consumer.OutcomeDuplicate:
		a.Result = Duplicate
	case consumer.OutcomeKeyReuse:
		a.Result, a.Reason = KeyReuse, ev.Reason
	case consumer.OutcomeInvalidKey:
		a.Result, a.Reason = InvalidKey, ev.Reason
		if errors.Is(ev.Err, dedup.ErrTenantInvalid) {
			a.Reason = ReasonTenantInvalid
		}
	default:
		a.Result, a.Reason = DeadLettered, fmt.Sprintf("%s %s: %v", ev.Outcome, ev.Reason, ev.Err)
	}
	switch a.Result {
	case Processed, Rejected, Duplicate:
		if ev.ReplyErr != nil {
			a.Reason = "reply: " + ev.ReplyErr.Error()
			break
		}
		if o.reply == nil {
			return // wait for it
		}
		code, _ := o.reply.Headers[wire.HeaderResponseCode].(int32)
		a.Code, a.Body = int(code), o.reply.Body
	}
	o.p.finish(a)
}

// CrashPoints runs ops through handle once per crash point of the crash
// kit, each point on a fresh store of the door's pool, in the door's mode.
func (d *consumerDoor) CrashPoints(t *testing.T, handle Handle, check func(ctx context.Context, store *dedup.Store) error, ops []Op) []CrashRow {
	pool := d.store.Pool()
	setup := func(tb testing.TB) consumertest.Subject {
		store := deduptest.Store(tb, pool, nil)
		schema := store.Config().Schema
		createEffects(tb, pool, schema)
		cfg := &consumer.Config{URL: testamqp.URL(),
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
		s := consumertest.Subject{Store: store, Mode: d.mode, Config: cfg,
			Check: func(ctx context.Context) error { return check(ctx, store) }}
		h := d.handler(handle, schema)
		if d.mode.Batch() {
			s.BatchHandler = asBatch(h)
		} else {
			s.Handler = h
		}
		return s
	}
	var msgs []amqp.Publishing
	for _, op := range ops {
		msg := amqp.Publishing{MessageId: op.Key, Body: op.Body, DeliveryMode: amqp.Persistent}
		if op.Tenant != "" {
			msg.Headers = amqp.Table{consumer.DefaultTenantHeader: op.Tenant}
		}
		msgs = append(msgs, msg)
	}
	rep := consumertest.CrashPoints(t, setup, msgs...)
	t.Logf("crash kit report (mode %s):\n%s", d.mode, rep)
	var rows []CrashRow
	for _, r := range rep.Rows {
		rows = append(rows, CrashRow{Point: r.Point, Reached: r.Reached, Err: r.Err})
	}
	return rows
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
