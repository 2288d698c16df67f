package demo

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/amqpdial"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/internal/wire"
)

// hintUp is appended to connection errors.
const hintUp = "start the local services with `make up` (or point the demo elsewhere with IDEMQ_POSTGRES_URL / IDEMQ_AMQP_URL)"

// waitFor retries try every 500ms until it succeeds, ctx ends or wait passes,
// so that a service restarting right now does not fail the demo.
func waitFor(ctx context.Context, wait time.Duration, try func(context.Context) error) error {
	deadline := time.Now().Add(wait)
	for {
		actx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := try(actx)
		cancel()
		if err == nil || ctx.Err() != nil || time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// connectPostgres opens the parent's pool once Postgres answers.
func connectPostgres(ctx context.Context, url string, wait time.Duration) (*pgxpool.Pool, error) {
	pool, err := newPool(ctx, url, 4, "idemq-demo", false)
	if err != nil {
		return nil, err
	}
	if err := waitFor(ctx, wait, pool.Ping); err != nil {
		pool.Close()
		return nil, fmt.Errorf("postgres at %s is not reachable after %s: %s; %s", redact.URL(url), wait, redact.Error(err), hintUp)
	}
	return pool, nil
}

// connectAMQP dials RabbitMQ once it answers.
func connectAMQP(ctx context.Context, url string, wait time.Duration) (*amqp.Connection, error) {
	var conn *amqp.Connection
	err := waitFor(ctx, wait, func(actx context.Context) error {
		c, err := amqpdial.DialURL(actx, url, "idemq-demo", 0)
		conn = c
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("rabbitmq at %s is not reachable after %s: %s; %s", redact.URL(url), wait, redact.Error(err), hintUp)
	}
	return conn, nil
}

// resetSchema drops the demo schema and creates it again: the key store's
// tables (schema.Migrate), the ledger of card charges, the publication log and
// the event log.
func resetSchema(ctx context.Context, pool *pgxpool.Pool, schemaName string) error {
	s := pgx.Identifier{schemaName}.Sanitize()
	if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+s+" CASCADE"); err != nil {
		return fmt.Errorf("reset schema %s: %w", schemaName, err)
	}
	if err := schema.Migrate(ctx, pool, schemaName); err != nil {
		return fmt.Errorf("reset schema %s: %w", schemaName, err)
	}
	ddl := `
-- The effect: one card charge per applied payment. Deliberately no unique
-- constraint on key: the key store is what must prevent a double charge, and
-- the report counts any.
CREATE TABLE ` + s + `.charges (
    id         bigserial   PRIMARY KEY,
    key        text        NOT NULL,
    account    text        NOT NULL,
    amount     bigint      NOT NULL,
    currency   text        NOT NULL,
    network    text        NOT NULL,
    worker     integer     NOT NULL,
    attempt    integer     NOT NULL,
    charged_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ON ` + s + `.charges (key);

-- What the publisher sent and the broker confirmed, in order.
CREATE TABLE ` + s + `.publications (
    seq          integer     PRIMARY KEY,
    key          text        NOT NULL,
    kind         text        NOT NULL,
    valid        boolean     NOT NULL, -- a valid key and a well-formed payment
    body         bytea       NOT NULL,
    published_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ON ` + s + `.publications (key, seq);

-- What the workers saw: one row per consumer.Event (best effort).
CREATE TABLE ` + s + `.events (
    id                bigserial   PRIMARY KEY,
    worker            integer     NOT NULL,
    outcome           text        NOT NULL,
    reason            text        NOT NULL,
    key_hash          text        NOT NULL,
    attempt           integer     NOT NULL,
    trace_id          text        NOT NULL,
    original_trace_id text        NOT NULL,
    error             text        NOT NULL,
    duration_us       bigint      NOT NULL,
    at                timestamptz NOT NULL DEFAULT now()
);`
	if _, err := pool.Exec(ctx, ddl); err != nil {
		return fmt.Errorf("create demo tables in %s: %w", schemaName, err)
	}
	return nil
}

// queueNames lists the queues of a topology: the work queue, the tiers, the DLQ.
func queueNames(t consumer.Topology) (work string, tiers []string, dlq string) {
	for _, d := range t.Delays {
		tiers = append(tiers, t.TierName(d))
	}
	return t.Queue, tiers, t.DLQ
}

// resetTopology deletes the demo's queues and exchange, then declares them
// afresh (Topology.Declare), so that nothing from an earlier run remains.
func resetTopology(conn *amqp.Connection, cfg *consumer.Config) error {
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("reset queues: open channel: %w", err)
	}
	defer ch.Close()
	topo := consumer.NewTopology(cfg.TopologyConfig()).OnBroker(consumer.BrokerVersion(conn))
	work, tiers, dlq := queueNames(topo)
	for _, q := range append([]string{work, dlq}, tiers...) {
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			return fmt.Errorf("reset queues: delete %s: %w", q, err)
		}
	}
	if err := ch.ExchangeDelete(topo.DLX, false, false); err != nil {
		return fmt.Errorf("reset queues: delete exchange: %w", err)
	}
	if err := topo.Declare(ch); err != nil {
		return fmt.Errorf("declare queues: %w", err)
	}
	return nil
}

// queueState is a snapshot of the demo's queues.
type queueState struct {
	Ready     int // messages ready in the work queue
	Consumers int // consumers of the work queue
	Retrying  int // messages waiting in the retry tiers
	DLQ       int // dead letters
}

// inspector reads queue depths with passive declares, on a connection of
// its own that it dials again when it was lost (a broker restart).
type inspector struct {
	url       string
	conn      *amqp.Connection
	ch        *amqp.Channel
	work, dlq string
	tiers     []string
}

func newInspector(url string, t consumer.Topology) *inspector {
	work, tiers, dlq := queueNames(t)
	return &inspector{url: url, work: work, tiers: tiers, dlq: dlq}
}

// channel returns an open channel, dialling again if needed.
func (in *inspector) channel() (*amqp.Channel, error) {
	if in.conn == nil || in.conn.IsClosed() {
		conn, err := amqpdial.DialURL(context.Background(), in.url, "idemq-demo-inspector", 0)
		if err != nil {
			return nil, err
		}
		in.conn, in.ch = conn, nil
	}
	if in.ch == nil || in.ch.IsClosed() {
		ch, err := in.conn.Channel()
		if err != nil {
			return nil, fmt.Errorf("open channel: %w", err)
		}
		in.ch = ch
	}
	return in.ch, nil
}

func (in *inspector) close() {
	if in.conn != nil {
		_ = in.conn.Close()
	}
}

func (in *inspector) state() (queueState, error) {
	var st queueState
	ch, err := in.channel()
	if err != nil {
		return st, fmt.Errorf("inspect queues: %w", err)
	}
	q, err := ch.QueueDeclarePassive(in.work, true, false, false, false, nil)
	if err != nil {
		return st, fmt.Errorf("inspect queue %s: %w", in.work, err)
	}
	st.Ready, st.Consumers = q.Messages, q.Consumers
	for _, name := range in.tiers {
		q, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
		if err != nil {
			return st, fmt.Errorf("inspect queue %s: %w", name, err)
		}
		st.Retrying += q.Messages
	}
	q, err = ch.QueueDeclarePassive(in.dlq, true, false, false, false, nil)
	if err != nil {
		return st, fmt.Errorf("inspect queue %s: %w", in.dlq, err)
	}
	st.DLQ = q.Messages
	return st, nil
}

// deadLetters reads every message of the DLQ without removing it (they go
// back to the queue when the channel closes, for `idemq dlq list`) and counts
// them by reason, with their message ids.
func (in *inspector) deadLetters() (count map[string]int, ids map[string][]string, err error) {
	if _, err := in.channel(); err != nil {
		return nil, nil, fmt.Errorf("inspect DLQ: %w", err)
	}
	ch, err := in.conn.Channel()
	if err != nil {
		return nil, nil, fmt.Errorf("inspect DLQ: open channel: %w", err)
	}
	defer ch.Close()
	count, ids = map[string]int{}, map[string][]string{}
	for {
		d, ok, err := ch.Get(in.dlq, false)
		if err != nil {
			return nil, nil, fmt.Errorf("inspect DLQ %s: %w", in.dlq, err)
		}
		if !ok {
			break
		}
		reason := wire.ReadLetter(&d).Label()
		count[reason]++
		ids[reason] = append(ids[reason], d.MessageId)
	}
	return count, ids, nil
}

var errNotSettled = errors.New("not every message settled")
