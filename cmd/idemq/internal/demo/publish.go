package demo

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/internal/confirm"
	"github.com/idemq/idemq/internal/msgspan"
)

// instrumentation names the demo's tracer.
const instrumentation = "github.com/idemq/idemq/cmd/idemq/internal/demo"

// confirmWindow is how many publications may await their confirm at once.
const confirmWindow = 256

// publisher publishes the plan with publisher confirms and logs every
// confirmed publication in the publications table.
type publisher struct {
	conn   *amqp.Connection
	pool   *pgxpool.Pool
	table  pgx.Identifier
	queue  string
	tracer trace.Tracer
	prop   propagation.TextMapPropagator
	// published counts confirmed publications.
	published atomic.Int64
	seq       int
}

func newPublisher(conn *amqp.Connection, pool *pgxpool.Pool, schema, queue string) *publisher {
	return &publisher{
		conn: conn, pool: pool, table: pgx.Identifier{schema, "publications"}, queue: queue,
		tracer: otel.Tracer(instrumentation), prop: otel.GetTextMapPropagator(),
	}
}

// inflight is a publication awaiting its confirm.
type inflight struct {
	seq  int
	msg  message
	conf *confirm.Pending
}

// run publishes every message of the plan, in order; the copies of a burst
// go out at once from as many goroutines.
func (p *publisher) run(ctx context.Context, msgs []message) error {
	ch, err := p.conn.Channel()
	if err != nil {
		return fmt.Errorf("publish: open channel: %w", err)
	}
	defer ch.Close()
	pub, err := confirm.New(ch, p.conn.Config.FrameSize)
	if err != nil {
		return fmt.Errorf("publish: %w", err)
	}

	var pending []inflight
	flush := func() error {
		if len(pending) == 0 {
			return nil
		}
		rows := make([][]any, 0, len(pending))
		for _, f := range pending {
			if err := f.conf.Wait(ctx); err != nil {
				return fmt.Errorf("publish: message %d to queue %s: %w", f.seq, p.queue, err)
			}
			_, perr := parsePayment(f.msg.Body)
			rows = append(rows, []any{int32(f.seq), f.msg.Key, string(f.msg.Kind), validKey(f.msg.Key) && perr == nil, f.msg.Body})
		}
		if _, err := p.pool.CopyFrom(ctx, p.table, []string{"seq", "key", "kind", "valid", "body"}, pgx.CopyFromRows(rows)); err != nil {
			return fmt.Errorf("publish: log publications: %w", err)
		}
		p.published.Add(int64(len(pending)))
		pending = pending[:0]
		return nil
	}

	for _, m := range msgs {
		if m.Copies > 1 {
			if err := flush(); err != nil {
				return err
			}
			burst, err := p.burst(ctx, pub, m)
			pending = burst
			if err != nil {
				return err
			}
			if err := flush(); err != nil {
				return err
			}
			continue
		}
		p.seq++
		conf, err := p.publish(ctx, pub, m)
		if err != nil {
			return err
		}
		pending = append(pending, inflight{seq: p.seq, msg: m, conf: conf})
		if len(pending) >= confirmWindow {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	return flush()
}

// burst publishes m.Copies copies of m from as many goroutines, released
// together.
func (p *publisher) burst(ctx context.Context, pub *confirm.Publisher, m message) ([]inflight, error) {
	out := make([]inflight, m.Copies)
	errs := make([]error, m.Copies)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range m.Copies {
		p.seq++
		out[i] = inflight{seq: p.seq, msg: m}
		wg.Go(func() {
			<-start
			out[i].conf, errs[i] = p.publish(ctx, pub, m)
		})
	}
	close(start)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return out, nil
}

// publish sends one message (mandatory, persistent) with a producer span
// whose context travels in the traceparent header.
func (p *publisher) publish(ctx context.Context, pub *confirm.Publisher, m message) (*confirm.Pending, error) {
	ctx, span := msgspan.StartPublish(ctx, p.tracer, msgspan.Publish{
		Name: p.queue + " publish", RoutingKey: p.queue,
		Attributes: []attribute.KeyValue{attribute.String("idemq.demo.kind", string(m.Kind))},
	})
	defer span.End()
	headers := amqp.Table{}
	msg := amqp.Publishing{
		Headers:      headers,
		ContentType:  "application/json",
		DeliveryMode: amqp.Persistent,
		Timestamp:    time.Now(),
		AppId:        "idemq-demo",
		Type:         "payment",
		Body:         m.Body,
	}
	switch {
	case m.InHeader:
		headers["Idempotency-Key"] = m.Key
	case m.Key != "":
		msg.MessageId = m.Key
	}
	p.prop.Inject(ctx, tableCarrier(headers))
	conf, err := pub.Publish(ctx, "", p.queue, msg)
	if err != nil {
		return nil, fmt.Errorf("publish to %s: %w", p.queue, err)
	}
	return conf, nil
}

// tableCarrier adapts amqp.Table to OpenTelemetry's TextMapCarrier.
type tableCarrier amqp.Table

func (c tableCarrier) Get(key string) string {
	s, _ := c[key].(string)
	return s
}

func (c tableCarrier) Set(key, value string) { c[key] = value }

func (c tableCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}
