package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"strings"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"

	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/claim"
	"github.com/idemq/idemq/internal/ordering"
	"github.com/idemq/idemq/internal/propagator"
	"github.com/idemq/idemq/internal/sweep"
)

// Message is one message to publish. Only Exchange or RoutingKey, and Body,
// are usually set; the rest mirror amqp.Publishing.
type Message struct {
	// Exchange and RoutingKey say where the relay publishes. "" is the
	// default exchange, where RoutingKey names a queue.
	Exchange, RoutingKey string
	// Headers are published as AMQP headers, unchanged: the consumer gets
	// what it would get had they been published directly (see
	// docs/outbox.md). The relay adds traceparent/tracestate.
	Headers amqp.Table
	Body    []byte
	// ContentType and ContentEncoding are the MIME properties.
	ContentType, ContentEncoding string
	// MessageID is published as the message_id property, the key downstream
	// consumers deduplicate on. Empty means derived from the claim in the
	// context (see Claim), or a random UUID when there is none.
	MessageID string
	// OrderingKey, when set, orders the message after every earlier message
	// with the same key: the relays publish one at a time per key, in id
	// order, which is commit order: the row takes its key's next sequence
	// in the enqueuing transaction, whose row lock orders the key's
	// writers. It is published with the headers x-ordering-key and
	// x-sequence (that sequence, counting from 1 per key and schema, with
	// no gap), unless Headers carry an x-sequence already (a forwarded
	// message keeps its publisher's). It costs throughput on that key; see
	// docs/outbox.md and docs/ordering.md.
	OrderingKey string
	// DeliveryMode is amqp.Persistent (the default, when zero) or amqp.Transient.
	DeliveryMode uint8
	// Priority is the AMQP priority, 0 to 9 in practice.
	Priority uint8
	// CorrelationID, ReplyTo, Expiration, Type and AppID are the AMQP properties of those names.
	CorrelationID, ReplyTo, Expiration, Type, AppID string
	// Format, when set, writes the message in another framework's format
	// when it is enqueued: a CloudEvent or MassTransit's envelope.
	Format Format
}

// Config configures an Outbox. A nil *Config means all defaults.
type Config struct {
	// Schema is the Postgres schema holding the outbox table (created by
	// schema.Migrate). Default schema.Default. The outbox's relays, its
	// retention and its backlog all work on this schema.
	Schema string
	// Propagator injects the caller's trace context into each row. Default:
	// the global propagator once a program has set one, else W3C
	// TraceContext + Baggage. Its whole carrier is kept: traceparent and
	// tracestate in columns of their own, every other field (baggage, B3,
	// Jaeger) among the row's headers. Give the relay the same propagator
	// (RelayConfig.Propagator) so that it reads them back.
	Propagator propagation.TextMapPropagator
	// MeterProvider makes the metrics of GC (idemq.gc.*, see
	// docs/observability.md). Default otel.GetMeterProvider(). A Relay
	// takes its own from RelayConfig.
	MeterProvider metric.MeterProvider
}

// WithDefaults returns a copy of c with every zero field set to its default.
func (c *Config) WithDefaults() Config {
	var out Config
	if c != nil {
		out = *c
	}
	out.Schema = cmp.Or(out.Schema, schema.Default)
	return out
}

func (c Config) validate() error {
	return schema.Validate(c.Schema)
}

// Outbox is the outbox table of one schema: it writes messages into it,
// always in the caller's transaction (Enqueue, EnqueueBatch), reports its
// backlog (Pending), deletes old rows (GC, GCParked), releases parked ones
// (Unpark), and is what a Relay publishes from (NewRelay). It is safe for
// concurrent use.
type Outbox struct {
	pool  *pgxpool.Pool
	cfg   Config
	table string
	// published is the record of published messages (migration 009).
	published string
	insert    string
	// insertNotify is insert with a NOTIFY of the relays, in one statement.
	insertNotify string
	// channel is the relays' LISTEN channel (ChannelName), which waker
	// notifies after commits (see WakeAfterCommit).
	channel string
	waker   *waker
	// nextSequences advances the ordering keys' counters (migration 010).
	nextSequences string

	gcMetrics *sweep.Metrics
}

// New returns the outbox in pool's database. A nil cfg means defaults. The
// table must exist: run schema.Migrate first (or `idemq migrate`).
func New(pool *pgxpool.Pool, cfg *Config) (*Outbox, error) {
	if pool == nil {
		return nil, errors.New("outbox: nil pool")
	}
	c := cfg.WithDefaults()
	if err := c.validate(); err != nil {
		return nil, fmt.Errorf("outbox: %w", err)
	}
	table := pgx.Identifier{c.Schema, "outbox"}.Sanitize()
	m, err := sweep.NewMetrics(c.MeterProvider, instrumentationName, c.Schema, "outbox")
	if err != nil {
		return nil, fmt.Errorf("outbox: metrics: %w", err)
	}
	channel := ChannelName(c.Schema)
	insert := `INSERT INTO ` + table + ` (` + columnList + `)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18)`
	return &Outbox{
		channel: channel,
		waker: &waker{notify: func(ctx context.Context) error {
			_, err := pool.Exec(ctx, wakeStatement, channel)
			return err
		}},
		pool:      pool,
		cfg:       c,
		table:     table,
		published: pgx.Identifier{c.Schema, "outbox_published"}.Sanitize(),
		gcMetrics: m,
		nextSequences: `INSERT INTO ` + pgx.Identifier{c.Schema, "outbox_sequences"}.Sanitize() + ` AS s (ordering_key, last_sequence)
SELECT k, count(*) FROM unnest($1::text[]) AS k GROUP BY k
ON CONFLICT (ordering_key) DO UPDATE SET last_sequence = s.last_sequence + excluded.last_sequence
RETURNING ordering_key, last_sequence`,
		insert:       insert,
		insertNotify: `WITH ins AS (` + insert + `) SELECT pg_notify($19, '')`,
	}, nil
}

// Config returns the outbox's configuration with defaults filled in.
func (o *Outbox) Config() Config { return o.cfg }

// columns are the ones Enqueue writes, in the order of row().
var columns = []string{
	"exchange", "routing_key", "headers_amqp", "body", "content_type", "content_encoding",
	"delivery_mode", "priority", "correlation_id", "reply_to", "expiration", "type", "app_id",
	"message_id", "ordering_key", "traceparent", "tracestate", "sequence",
}

// Where row() puts the ordering key and the sequence.
const (
	orderingKeyColumn = 14
	sequenceColumn    = 17
)

// sequenceDue stands in a row's sequence column until the row is written:
// the row takes its ordering key's next sequence then (assignSequences).
type sequenceDue struct{}

var columnList = func() string {
	s := ""
	for i, c := range columns {
		if i > 0 {
			s += ", "
		}
		s += c
	}
	return s
}()

// Enqueue writes msg into the outbox in tx, the caller's transaction: the
// message is published if and only if tx commits. A relay publishes it soon
// after the commit: Enqueue sends a NOTIFY in tx (delivered at the commit),
// or, where ctx asks for it (WakeAfterCommit), leaves the wake-up to a Wake
// after the commit. In a handler the consumer runs, on the transaction the
// handler was given, the row is deferred: the runtime writes the rows of the
// whole group with one statement before it completes the keys (see
// Deferred), and wakes the relays after its commit.
func (o *Outbox) Enqueue(ctx context.Context, tx pgx.Tx, msg Message) error {
	if tx == nil {
		return errors.New("outbox: enqueue: nil transaction")
	}
	row, err := o.row(ctx, msg)
	if err != nil {
		return fmt.Errorf("outbox: enqueue: %w", err)
	}
	if d := deferredFor(ctx, tx); d != nil {
		d.add(o, row)
		return nil
	}
	if err := o.assignSequences(ctx, tx, [][]any{row}); err != nil {
		return fmt.Errorf("outbox: enqueue: %w", err)
	}
	if w := wakesFrom(ctx); w != nil {
		if _, err := tx.Exec(ctx, o.insert, row...); err != nil {
			return fmt.Errorf("outbox: enqueue: %w", err)
		}
		w.add(o)
		return nil
	}
	if _, err := tx.Exec(ctx, o.insertNotify, append(row, o.channel)...); err != nil {
		return fmt.Errorf("outbox: enqueue: %w", err)
	}
	return nil
}

// assignSequences gives each row whose sequence is due its ordering key's
// next sequences, in row order, with one statement in tx. The counter rows
// it advances stay locked until tx ends, so the key's next writer waits
// and its sequences, ids and commit follow this one's.
func (o *Outbox) assignSequences(ctx context.Context, tx pgx.Tx, rows [][]any) error {
	var keys []string
	count := map[string]int64{}
	for _, r := range rows {
		if _, due := r[sequenceColumn].(sequenceDue); due {
			k := r[orderingKeyColumn].(string)
			keys = append(keys, k)
			count[k]++
		}
	}
	if len(keys) == 0 {
		return nil
	}
	rs, err := tx.Query(ctx, o.nextSequences, keys)
	if err != nil {
		return fmt.Errorf("assign sequences: %w", err)
	}
	// next is each key's first sequence for these rows.
	next := map[string]int64{}
	for rs.Next() {
		var k string
		var last int64
		if err := rs.Scan(&k, &last); err != nil {
			rs.Close()
			return fmt.Errorf("assign sequences: %w", err)
		}
		next[k] = last - count[k] + 1
	}
	if err := rs.Err(); err != nil {
		return fmt.Errorf("assign sequences: %w", err)
	}
	for _, r := range rows {
		if _, due := r[sequenceColumn].(sequenceDue); due {
			k := r[orderingKeyColumn].(string)
			r[sequenceColumn] = next[k]
			next[k]++
		}
	}
	return nil
}

// EnqueueBatch writes msgs into the outbox in tx with one COPY (deferred
// like Enqueue's), and wakes the relays as Enqueue does (a NOTIFY in tx
// after the COPY, or Wake after the commit). Messages without a MessageID
// take claim sequence numbers in slice order.
func (o *Outbox) EnqueueBatch(ctx context.Context, tx pgx.Tx, msgs []Message) error {
	if tx == nil {
		return errors.New("outbox: enqueue batch: nil transaction")
	}
	if len(msgs) == 0 {
		return nil
	}
	rows := make([][]any, len(msgs))
	for i, m := range msgs {
		row, err := o.row(ctx, m)
		if err != nil {
			return fmt.Errorf("outbox: enqueue batch: message %d: %w", i, err)
		}
		rows[i] = row
	}
	if d := deferredFor(ctx, tx); d != nil {
		for _, row := range rows {
			d.add(o, row)
		}
		return nil
	}
	if err := o.copyRows(ctx, tx, rows); err != nil {
		return fmt.Errorf("outbox: enqueue batch: %w", err)
	}
	return nil
}

// copyRows writes rows into the outbox in tx with one COPY, and wakes the
// relays (wakeRelays).
func (o *Outbox) copyRows(ctx context.Context, tx pgx.Tx, rows [][]any) error {
	if err := o.assignSequences(ctx, tx, rows); err != nil {
		return err
	}
	if _, err := tx.CopyFrom(ctx, pgx.Identifier{o.cfg.Schema, "outbox"}, columns, pgx.CopyFromRows(rows)); err != nil {
		return err
	}
	return o.wakeRelays(ctx, tx)
}

// row checks msg, fills its defaults and returns its column values.
func (o *Outbox) row(ctx context.Context, m Message) ([]any, error) {
	if m.DeliveryMode == 0 {
		m.DeliveryMode = amqp.Persistent
	}
	if m.DeliveryMode != amqp.Persistent && m.DeliveryMode != amqp.Transient {
		return nil, fmt.Errorf("delivery mode %d: want amqp.Persistent or amqp.Transient", m.DeliveryMode)
	}
	if strings.Trim(m.Expiration, "0123456789") != "" {
		return nil, fmt.Errorf("expiration %q: want a number of milliseconds", m.Expiration)
	}
	if err := finite(m.Headers); err != nil {
		return nil, fmt.Errorf("headers: %w", err)
	}
	if m.Body == nil {
		m.Body = []byte{}
	}
	if m.MessageID == "" {
		if id, ok := claim.Next(ctx); ok {
			m.MessageID = id
		} else {
			m.MessageID = uuid.NewString()
		}
	}
	if m.Format != nil {
		if err := m.Format.write(&m); err != nil {
			return nil, err
		}
	}
	var traceparent, tracestate any
	carrier := propagation.MapCarrier{}
	propagator.Or(o.cfg.Propagator).Inject(ctx, carrier)
	if v := carrier["traceparent"]; v != "" {
		traceparent = v
	}
	if v := carrier["tracestate"]; v != "" {
		tracestate = v
	}
	delete(carrier, "traceparent")
	delete(carrier, "tracestate")
	if len(carrier) > 0 {
		// The rest of the propagator's carrier (baggage, B3, Jaeger's
		// uber-trace-id) travels in the row's headers, where the relay's
		// propagator reads it back and its publish span replaces it.
		h := make(amqp.Table, len(m.Headers)+len(carrier))
		maps.Copy(h, m.Headers)
		for k, v := range carrier {
			h[k] = v
		}
		m.Headers = h
	}
	headers, err := encodeHeaders(m.Headers)
	if err != nil {
		return nil, err
	}
	var hdr, orderingKey, sequence any
	if headers != nil {
		hdr = headers
	}
	if m.OrderingKey != "" {
		orderingKey = m.OrderingKey
		if _, own := m.Headers[ordering.HeaderSequence]; !own {
			sequence = sequenceDue{}
		}
	}
	return []any{
		m.Exchange, m.RoutingKey, hdr, m.Body, m.ContentType, m.ContentEncoding,
		int16(m.DeliveryMode), int16(m.Priority), m.CorrelationID, m.ReplyTo, m.Expiration, m.Type, m.AppID,
		m.MessageID, orderingKey, traceparent, tracestate, sequence,
	}, nil
}

// ErrNoOutbox is what the package-level Enqueue and EnqueueBatch return
// when the context carries no Outbox (see NewContext).
var ErrNoOutbox = errors.New("no outbox in the context: call Outbox.Enqueue, or enqueue from a handler the consumer runs")

type outboxKey struct{}

// NewContext returns a context carrying o, for the package-level Enqueue and
// EnqueueBatch. The consumer runtime puts the outbox of its store's schema
// into every handler's context.
func NewContext(ctx context.Context, o *Outbox) context.Context {
	return context.WithValue(ctx, outboxKey{}, o)
}

// FromContext returns the Outbox carried by ctx, if any.
func FromContext(ctx context.Context) (*Outbox, bool) {
	o, ok := ctx.Value(outboxKey{}).(*Outbox)
	return o, ok && o != nil
}

// Enqueue is Outbox.Enqueue on the outbox carried by ctx (NewContext): in a
// handler the consumer runs, that of the consumer's store. Without one it
// returns ErrNoOutbox.
func Enqueue(ctx context.Context, tx pgx.Tx, msg Message) error {
	o, ok := FromContext(ctx)
	if !ok {
		return fmt.Errorf("outbox: enqueue: %w", ErrNoOutbox)
	}
	return o.Enqueue(ctx, tx, msg)
}

// EnqueueBatch is Outbox.EnqueueBatch on the outbox carried by ctx, like
// Enqueue.
func EnqueueBatch(ctx context.Context, tx pgx.Tx, msgs []Message) error {
	o, ok := FromContext(ctx)
	if !ok {
		return fmt.Errorf("outbox: enqueue batch: %w", ErrNoOutbox)
	}
	return o.EnqueueBatch(ctx, tx, msgs)
}

// finite refuses NaN and infinite floats, which RabbitMQ answers by closing
// the connection.
func finite(v any) error {
	switch x := v.(type) {
	case float32:
		return finite(float64(x))
	case float64:
		if math.IsNaN(x) || math.IsInf(x, 0) {
			return fmt.Errorf("%v: RabbitMQ cannot carry a non-finite float", x)
		}
	case []any:
		for _, e := range x {
			if err := finite(e); err != nil {
				return err
			}
		}
	case amqp.Table:
		for k, e := range x {
			if err := finite(e); err != nil {
				return fmt.Errorf("field %q: %w", k, err)
			}
		}
	}
	return nil
}
