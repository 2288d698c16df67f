package outbox

import (
	"cmp"
	"context"
	"fmt"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// Backlog describes the rows not yet published.
type Backlog struct {
	// Pending counts rows waiting to be published (including rows in
	// backoff after a failed attempt).
	Pending int64
	// OldestAge is the age of the oldest pending row, 0 when none is.
	OldestAge time.Duration
	// Parked counts rows parked as unroutable; they wait for an operator.
	Parked int64
}

// Pending reports the backlog of the outbox.
func (o *Outbox) Pending(ctx context.Context) (Backlog, error) {
	t := o.table
	var b Backlog
	var ageUS int64
	err := o.pool.QueryRow(ctx, `SELECT
    (SELECT count(*) FROM `+t+` WHERE published_at IS NULL AND parked_at IS NULL),
    coalesce((SELECT (extract(epoch FROM now() - min(created_at)) * 1e6)::bigint
              FROM `+t+` WHERE published_at IS NULL AND parked_at IS NULL), 0),
    (SELECT count(*) FROM `+t+` WHERE parked_at IS NOT NULL)`).Scan(&b.Pending, &ageUS, &b.Parked)
	if err != nil {
		return Backlog{}, fmt.Errorf("outbox: pending: %w", err)
	}
	b.OldestAge = time.Duration(max(ageUS, 0)) * time.Microsecond
	return b, nil
}

// Stats is a relay's view: the outbox backlog and the relay's own counters
// since it was made.
type Stats struct {
	Backlog Backlog
	// Published counts messages confirmed by the broker and marked.
	Published int64
	// Returned counts messages that came back unroutable or found their
	// exchange missing.
	Returned int64
	// Nacked counts messages the broker refused.
	Nacked int64
	// TimedOut counts messages whose confirm did not come in time.
	TimedOut int64
	// Parked counts messages this relay parked.
	Parked int64
	// Reconnects counts broker sessions that failed or were lost.
	Reconnects int64
}

// Stats returns the relay's counters and the outbox backlog.
func (r *Relay) Stats(ctx context.Context) (Stats, error) {
	b, err := r.ob.Pending(ctx)
	s := Stats{
		Backlog:    b,
		Published:  r.counts.published.Load(),
		Returned:   r.counts.returned.Load(),
		Nacked:     r.counts.nacked.Load(),
		TimedOut:   r.counts.timedOut.Load(),
		Parked:     r.counts.parked.Load(),
		Reconnects: r.counts.reconnects.Load(),
	}
	return s, err
}

// instruments are the relay's OTel metrics. Names follow docs/outbox.md.
type instruments struct {
	meter                                                     metric.Meter
	attrs                                                     metric.MeasurementOption
	published, returned, nacked, timedOut, parked, reconnects metric.Int64Counter
	lag                                                       metric.Float64Histogram
	pending, parkedRows                                       metric.Int64ObservableGauge
	oldestAge                                                 metric.Float64ObservableGauge
}

func newInstruments(mp metric.MeterProvider) (instruments, error) {
	m := cmp.Or[metric.MeterProvider](mp, otel.GetMeterProvider()).Meter(instrumentationName)
	in := instruments{meter: m}
	var err error
	counter := func(name, desc string) metric.Int64Counter {
		if err != nil {
			return nil
		}
		var c metric.Int64Counter
		c, err = m.Int64Counter(name, metric.WithDescription(desc), metric.WithUnit("{message}"))
		return c
	}
	in.published = counter("idemq.outbox.published", "Outbox messages confirmed by the broker.")
	in.returned = counter("idemq.outbox.returned", "Outbox messages returned unroutable (or whose exchange is missing).")
	in.nacked = counter("idemq.outbox.nacked", "Outbox messages nacked by the broker.")
	in.timedOut = counter("idemq.outbox.confirm_timeouts", "Outbox messages whose publisher confirm timed out.")
	in.parked = counter("idemq.outbox.parked", "Outbox messages parked after repeated returns.")
	in.reconnects = counter("idemq.outbox.reconnects", "Broker sessions of the relay that failed or were lost.")
	if err != nil {
		return in, err
	}
	if in.lag, err = m.Float64Histogram("idemq.outbox.lag",
		metric.WithDescription("Time from the enqueueing transaction's start to the broker's confirm."),
		metric.WithUnit("s")); err != nil {
		return in, err
	}
	if in.pending, err = m.Int64ObservableGauge("idemq.outbox.pending",
		metric.WithDescription("Outbox rows waiting to be published."), metric.WithUnit("{message}")); err != nil {
		return in, err
	}
	if in.parkedRows, err = m.Int64ObservableGauge("idemq.outbox.parked_rows",
		metric.WithDescription("Outbox rows parked, waiting for an operator."), metric.WithUnit("{message}")); err != nil {
		return in, err
	}
	if in.oldestAge, err = m.Float64ObservableGauge("idemq.outbox.oldest_age",
		metric.WithDescription("Age of the oldest pending outbox row."), metric.WithUnit("s")); err != nil {
		return in, err
	}
	return in, nil
}

// registerGauges reports the backlog while the relay runs; it returns the
// function that stops it.
func (r *Relay) registerGauges() func() {
	set := schemaAttrs(r.ob.cfg.Schema)
	reg, err := r.inst.meter.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		b, err := r.ob.Pending(ctx)
		if err != nil {
			return err
		}
		opt := metric.WithAttributeSet(set)
		o.ObserveInt64(r.inst.pending, b.Pending, opt)
		o.ObserveInt64(r.inst.parkedRows, b.Parked, opt)
		o.ObserveFloat64(r.inst.oldestAge, b.OldestAge.Seconds(), opt)
		return nil
	}, r.inst.pending, r.inst.parkedRows, r.inst.oldestAge)
	if err != nil {
		r.log.Warn("outbox relay cannot register its backlog gauges", "error", err)
		return func() {}
	}
	return func() { _ = reg.Unregister() }
}

func schemaAttrs(schema string) attribute.Set {
	return attribute.NewSet(attribute.String("idemq.schema", schema))
}
