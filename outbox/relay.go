package outbox

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/amqpdial"
	"github.com/idemq/idemq/internal/confirm"
	"github.com/idemq/idemq/internal/cork"
	"github.com/idemq/idemq/internal/outage"
	"github.com/idemq/idemq/internal/pgfatal"
	"github.com/idemq/idemq/internal/propagator"
	"github.com/idemq/idemq/internal/relaykit"
)

// instrumentationName names the relay's tracer and meter.
const instrumentationName = "github.com/idemq/idemq/outbox"

// Relay publishes the outbox's rows with publisher confirms. Several relays
// may run side by side on one outbox: each claims its own rows (FOR UPDATE
// SKIP LOCKED). See Run.
type Relay struct {
	ob     *Outbox
	pool   *pgxpool.Pool
	dial   func(context.Context) (*amqp.Connection, *cork.Conn, error)
	cfg    RelayConfig
	sql    relayStatements
	log    *slog.Logger
	tracer trace.Tracer
	prop   propagation.TextMapPropagator
	inst   instruments

	// brokerOutage and dbOutage log the outages of the broker and of the
	// database that the relay's lanes (and, for the database, its schema
	// check and its LISTEN connection) meet: one line each when one starts,
	// at most one per interval while it lasts, one when it ends.
	brokerOutage, dbOutage *outage.Log

	running atomic.Bool
	// connected: a lane of this Run got a broker session; from then on a
	// refusal is retried.
	connected atomic.Bool
	counts    struct {
		published, returned, nacked, timedOut, parked, reconnects atomic.Int64
	}
	// afterConfirm is nil but in the crash test kit's relays (see
	// internal/relaykit).
	afterConfirm func(ctx context.Context) (crash bool)
}

func init() {
	relaykit.SetAfterConfirm = func(r any, hook func(context.Context) bool) { r.(*Relay).afterConfirm = hook }
}

// NewRelay returns a relay that moves the rows of ob to the broker at
// amqpURL (unused when cfg.Dial is set): one AMQP URL, or several separated
// by commas (the nodes of a cluster), of which each connect takes the first
// that answers, tried in a fresh random order. A nil cfg means defaults. The
// URLs are never logged.
func NewRelay(ob *Outbox, amqpURL string, cfg *RelayConfig) (*Relay, error) {
	if ob == nil {
		return nil, errors.New("outbox: new relay: nil outbox")
	}
	c := cfg.WithDefaults()
	if err := c.validate(); err != nil {
		return nil, fmt.Errorf("outbox: new relay: %w", err)
	}
	// A connection the relay dials itself sends each batch in one write
	// (internal/cork); one from cfg.Dial writes every publish as it comes.
	var dial func(context.Context) (*amqp.Connection, *cork.Conn, error)
	if c.Dial != nil {
		dial = func(ctx context.Context) (*amqp.Connection, *cork.Conn, error) {
			conn, err := c.Dial(ctx)
			return conn, nil, err
		}
	} else {
		if amqpURL == "" {
			return nil, errors.New("outbox: new relay: no broker URL and no Dial function")
		}
		addrs, err := amqpdial.Parse(amqpURL)
		if err != nil {
			return nil, fmt.Errorf("outbox: new relay: %w", err)
		}
		d := &amqpdial.Dialer{Addrs: addrs, Name: c.ConnectionName, Timeout: DefaultDialTimeout}
		dial = d.DialHeld
	}
	schema := ob.cfg.Schema
	r := &Relay{
		ob:     ob,
		pool:   ob.pool,
		dial:   dial,
		cfg:    c,
		sql:    newRelayStatements(schema),
		log:    cmp.Or(c.Logger, slog.Default()).With("component", "outbox-relay", "schema", schema),
		tracer: cmp.Or[trace.TracerProvider](c.TracerProvider, otel.GetTracerProvider()).Tracer(instrumentationName),
		prop:   propagator.Or(c.Propagator),
	}
	r.brokerOutage = outage.New(r.log, "outbox relay broker connection", 0)
	r.dbOutage = outage.New(r.log, "outbox relay database connection", 0)
	inst, err := newInstruments(c.MeterProvider)
	if err != nil {
		return nil, fmt.Errorf("outbox: new relay: metrics: %w", err)
	}
	r.inst = inst
	r.inst.attrs = metric.WithAttributeSet(schemaAttrs(schema))
	return r, nil
}

// Config returns the relay's configuration with defaults filled in.
func (r *Relay) Config() RelayConfig { return r.cfg }

// Run relays until ctx ends, then finishes the batch in flight, closes its
// connections and returns nil. Broker and database failures are retried
// with backoff: rows whose batch did not commit stay pending and are
// published again later, with the same message id. Run returns an error
// when called while already running, when the outbox's schema is not
// migrated as far as this build needs (schema.Check: run `idemq migrate`),
// when Postgres refuses for good (a wrong password, no such role or
// database, no privilege on the schema),
// and when the broker refuses its first connection for a reason retrying
// cannot fix (credentials or permissions, 403 ACCESS_REFUSED; a vhost, 530
// NOT_ALLOWED). A database or broker out of reach is retried from the
// start, and once connected every failure is retried.
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("outbox: relay is already running")
	}
	defer r.running.Store(false)
	r.connected.Store(false)
	if err := r.checkSchema(ctx); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	unregister := r.registerGauges()
	defer unregister()

	lanes := make([]*lane, r.cfg.Lanes)
	for i := range lanes {
		lanes[i] = &lane{wake: make(chan struct{}, 1)}
	}
	var (
		wg       sync.WaitGroup
		failOnce sync.Once
		failed   error
	)
	if !r.cfg.NoNotify {
		wg.Go(func() { r.listen(ctx, lanes) })
	}
	for _, l := range lanes {
		wg.Go(func() {
			if err := r.runLane(ctx, l); err != nil {
				failOnce.Do(func() { failed = err })
				cancel()
			}
		})
	}
	wg.Wait()
	return failed
}

// checkSchema waits, with backoff while the database is out of reach, for
// the outbox's schema to be checked (schema.Check). A schema not migrated
// far enough is an error; ctx ending is not.
func (r *Relay) checkSchema(ctx context.Context) error {
	bo := r.reconnectBackoff()
	for {
		started := r.dbOutage.Attempt()
		err := schema.Check(ctx, r.pool, r.ob.cfg.Schema)
		switch {
		case err == nil:
			r.dbOutage.Recovered(ctx, started)
			return nil
		case ctx.Err() != nil:
			return nil
		case errors.Is(err, schema.ErrNotMigrated):
			return fmt.Errorf("outbox: relay: %w", err)
		case pgfatal.Refused(err):
			return fmt.Errorf("outbox: relay: %w", pgfatal.Explain(err))
		}
		r.dbOutage.Failed(ctx, "outbox relay cannot check its schema; retrying", err)
		if !sleepCtx(ctx, bo.NextBackOff()) {
			return nil
		}
	}
}

// lane is one batch in flight at a time, on a broker session of its own.
type lane struct {
	wake chan struct{} // a NOTIFY came: look for rows
	// isolate is how many more rows to publish one per batch, after the
	// broker closed the channel during a batch (see suspect).
	isolate int
}

// runLane relays batches on one lane until ctx ends, reconnecting with
// backoff. It returns an error only for a refusal of the broker before any
// lane connected (see amqpdial.Refused).
func (r *Relay) runLane(ctx context.Context, l *lane) error {
	bo := r.reconnectBackoff()
	for ctx.Err() == nil {
		started := r.brokerOutage.Attempt()
		s, err := r.connect(ctx)
		if err != nil {
			if ctx.Err() != nil {
				break
			}
			if !r.connected.Load() {
				if amqpdial.Refused(err) {
					return fmt.Errorf("outbox: relay: %w", err)
				}
				r.brokerOutage.Failed(ctx, "outbox relay cannot reach the broker (never connected yet); retrying", err)
			} else {
				r.brokerOutage.Failed(ctx, "outbox relay cannot reach the broker; retrying", err)
			}
			r.reconnected(ctx)
			if !sleepCtx(ctx, bo.NextBackOff()) {
				break
			}
			continue
		}
		r.connected.Store(true)
		r.brokerOutage.Recovered(ctx, started)
		served, err := r.serve(ctx, s, l)
		s.Close()
		if err == nil || ctx.Err() != nil {
			break
		}
		if served {
			bo.Reset()
		}
		r.brokerOutage.Failed(ctx, "outbox relay lost the broker connection; reconnecting", err)
		r.reconnected(ctx)
		if !sleepCtx(ctx, bo.NextBackOff()) {
			break
		}
	}
	return nil
}

func (r *Relay) reconnected(ctx context.Context) {
	r.counts.reconnects.Add(1)
	r.inst.reconnects.Add(ctx, 1, r.inst.attrs)
}

func (r *Relay) reconnectBackoff() *backoff.ExponentialBackOff {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval = r.cfg.ReconnectInitial
	bo.MaxInterval = r.cfg.ReconnectMax
	bo.MaxElapsedTime = 0
	bo.Reset()
	return bo
}

// serve runs batches on one broker session until ctx ends (nil) or the
// session breaks (its error). served reports that a batch got through.
func (r *Relay) serve(ctx context.Context, s *session, l *lane) (served bool, err error) {
	dbBackoff := r.reconnectBackoff()
	poll := time.NewTimer(r.cfg.PollInterval)
	defer poll.Stop()
	for ctx.Err() == nil {
		started := r.dbOutage.Attempt()
		full, err := r.relayBatch(ctx, s, l)
		var be *brokerError
		switch {
		case errors.As(err, &be):
			return served, be.err
		case err != nil:
			r.dbOutage.Failed(ctx, "outbox relay database error; retrying", err)
			if !sleepCtx(ctx, dbBackoff.NextBackOff()) {
				return served, nil
			}
			continue
		}
		dbBackoff.Reset()
		r.dbOutage.Recovered(ctx, started)
		served = true
		if full {
			continue // more may be waiting
		}
		if !poll.Stop() {
			select {
			case <-poll.C:
			default:
			}
		}
		poll.Reset(r.cfg.PollInterval)
		select {
		case <-ctx.Done():
		case <-l.wake:
		case <-poll.C:
		case <-s.Dead():
			return served, s.deathErr()
		}
	}
	return served, nil
}

// sleepCtx waits d or until ctx ends; it reports whether ctx is still live.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// listen keeps a dedicated connection LISTENing on the outbox's channel and
// wakes every lane for every notification (and after every reconnect, in
// case one was missed), until ctx ends.
func (r *Relay) listen(ctx context.Context, lanes []*lane) {
	signal := func() {
		for _, l := range lanes {
			select {
			case l.wake <- struct{}{}:
			default:
			}
		}
	}
	bo := r.reconnectBackoff()
	channel := ChannelName(r.ob.cfg.Schema)
	deaf := false
	for ctx.Err() == nil {
		started := r.dbOutage.Attempt()
		err := func() error {
			cfg := cmp.Or(r.cfg.ListenConfig, r.pool.Config().ConnConfig).Copy()
			if cfg.RuntimeParams == nil {
				cfg.RuntimeParams = map[string]string{}
			}
			cfg.RuntimeParams["application_name"] = r.cfg.ConnectionName + "-listen"
			conn, err := pgx.ConnectConfig(ctx, cfg)
			if err != nil {
				return fmt.Errorf("connect: %w", err)
			}
			defer func() {
				cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
				defer cancel()
				_ = conn.Close(cctx)
			}()
			if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{channel}.Sanitize()); err != nil {
				return fmt.Errorf("listen: %w", err)
			}
			heard, err := r.hears(ctx, conn, channel, signal)
			if err != nil {
				return err
			}
			bo.Reset()
			r.dbOutage.Recovered(ctx, started)
			signal()
			if !heard {
				return errDeaf
			}
			for {
				if _, err := conn.WaitForNotification(ctx); err != nil {
					return fmt.Errorf("wait for notification: %w", err)
				}
				signal()
			}
		}()
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, errDeaf) {
			// Said once; tried again now and then, in case the probe was
			// only slow (a loaded server) or the pooler went.
			if !deaf {
				r.log.WarnContext(ctx, "outbox relay: its LISTEN connection does not hear NOTIFY (a transaction pooler such as PgBouncer between it and Postgres?); polling every "+r.cfg.PollInterval.String()+" instead: give the relay a direct connection for LISTEN (RelayConfig.ListenConfig, idemq --postgres-direct-url)",
					slog.String("channel", channel))
				deaf = true
			}
			if !sleepCtx(ctx, deafRetry) {
				return
			}
			continue
		}
		r.dbOutage.Failed(ctx, "outbox relay LISTEN connection failed; polling until it is back", err)
		if !sleepCtx(ctx, bo.NextBackOff()) {
			return
		}
	}
}

// errDeaf is a LISTEN connection that did not hear its own probe.
var errDeaf = errors.New("the LISTEN connection hears no notification")

// probeWait bounds how long a new LISTEN connection waits for its probe;
// deafRetry is how long the relay polls before it tries a LISTEN again after
// one that heard nothing.
const (
	probeWait = 10 * time.Second
	deafRetry = time.Minute
)

// hears reports whether conn, LISTENing on channel, hears a notification
// sent through the pool: through a transaction pooler the LISTEN was made
// by a backend that serves others now, and nothing reaches conn. Other
// notifications that come meanwhile are signalled.
func (r *Relay) hears(ctx context.Context, conn *pgx.Conn, channel string, signal func()) (bool, error) {
	var b [8]byte
	_, _ = rand.Read(b[:])
	probe := "idemq-listen-probe-" + hex.EncodeToString(b[:])
	if _, err := r.pool.Exec(ctx, "SELECT pg_notify($1, $2)", channel, probe); err != nil {
		return false, fmt.Errorf("probe: %w", err)
	}
	wctx, cancel := context.WithTimeout(ctx, probeWait)
	defer cancel()
	for {
		n, err := conn.WaitForNotification(wctx)
		switch {
		case err != nil && ctx.Err() == nil && wctx.Err() != nil:
			return false, nil
		case err != nil:
			return false, fmt.Errorf("wait for the probe: %w", err)
		case n.Payload == probe:
			return true, nil
		}
		signal()
	}
}

// brokerError marks a failure of the broker session: the batch rolls back
// and the relay reconnects.
type brokerError struct{ err error }

func (e *brokerError) Error() string { return "broker: " + e.err.Error() }
func (e *brokerError) Unwrap() error { return e.err }

// session is one lane's broker session (confirm.Session) and, when the
// relay dialed the connection, the cork that holds its writes (see hold).
type session struct {
	*confirm.Session
	// held carries the connection's bytes (nil for RelayConfig.Dial).
	held *cork.Conn
}

func (r *Relay) connect(ctx context.Context) (*session, error) {
	conn, held, err := r.dial(ctx)
	if err != nil {
		return nil, fmt.Errorf("dial: %w", err)
	}
	cs, err := confirm.Open(conn, DefaultExchangeCacheTime)
	if err != nil {
		return nil, err
	}
	return &session{Session: cs, held: held}, nil
}

// deathErr is why the session died (amqp.ErrClosed when the broker gave
// no reason).
func (s *session) deathErr() error {
	if err := s.Err(); err != nil {
		return err
	}
	return amqp.ErrClosed
}

// hold keeps the session's writes back, to be sent together by release:
// a batch's publishes go out in one write instead of one each. Nothing that
// waits for the broker's answer may run between the two.
func (s *session) hold() {
	if s.held != nil {
		s.held.Hold()
	}
}

// release sends what hold kept back. Its error is the connection's: the
// cork closed it, and the batch's confirms will not come.
func (s *session) release() error {
	if s.held == nil {
		return nil
	}
	if err := s.held.Release(); err != nil {
		return &brokerError{fmt.Errorf("send the batch: %w", err)}
	}
	return nil
}

// exchangeExists reports whether the exchange exists. Publishing to a missing
// exchange would close the publishing channel and fail the whole batch, so
// each exchange is checked first (confirm.Session.CheckExchange, trusted
// for DefaultExchangeCacheTime). It runs inside publishAll, while the
// batch's writes are held: a probe sends them first and holds the writes
// again after its answer.
func (s *session) exchangeExists(name string) (bool, error) {
	if s.ExchangeKnown(name) {
		return true, nil
	}
	if err := s.release(); err != nil {
		return false, err
	}
	defer s.hold()
	err := s.CheckExchange(name)
	var missing *confirm.ReturnError
	switch {
	case err == nil:
		return true, nil
	case errors.As(err, &missing):
		return false, nil
	}
	return false, &brokerError{err}
}
