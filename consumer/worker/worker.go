// Package worker runs a consumer with what runs beside it in one process:
// the outbox relay that publishes what its handlers enqueue and, when asked,
// retention of the key store and the outbox — under one context, so that a
// program needs one call:
//
//	w, err := worker.New(store, handle, &worker.Config{
//		Consumer: consumer.Config{URL: amqpURL, Queue: "payments", Name: "charge"},
//	})
//	if err != nil {
//		return err
//	}
//	return w.Run(ctx)
//
// # Lifecycle
//
// Run starts the relay first, then the consumer (and the retention loop).
// When ctx ends, the consumer stops taking deliveries and drains (as
// consumer.Consumer.Run does); then the relay keeps publishing until the
// outbox is empty or Config.DrainTimeout passes, so that what the last
// handlers committed leaves before Run returns (rows left behind are
// published by the next relay to run: none is lost). The first part to fail
// stops the others: a relay that stops with an error ends the consumer, a
// consumer that stops with an error ends the relay, and Run returns that
// error. Retention failures are logged and tried again at the next interval;
// they stop nothing.
package worker

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/amqpdial"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/outbox"
)

// DefaultDrainTimeout bounds the relay's last flush after the consumer
// stopped.
const DefaultDrainTimeout = outbox.DefaultDrainTimeout

// Config configures a Worker.
type Config struct {
	// Consumer configures the consumer (required: URL, Queue, Name).
	Consumer consumer.Config
	// Relay configures the relay of the consumer's outbox. Its broker is the
	// consumer's (URL and AMQPConfig) unless Relay.Dial is set; its tracer
	// and meter providers, propagator and logger are the consumer's where
	// left nil, so that a trace crosses the outbox in the consumer's
	// propagation format.
	Relay outbox.RelayConfig
	// NoRelay runs no relay: another process relays this schema's outbox
	// (idemq relay).
	NoRelay bool
	// DrainTimeout bounds how long the relay keeps publishing after the
	// consumer stopped. Default DefaultDrainTimeout.
	DrainTimeout time.Duration
	// GC, when set, runs retention in the worker.
	GC *GC
}

// GC is retention run by the worker: every Every, the completed keys older
// than Keys.Retention and then the outbox's published rows older than
// Outbox.Retention are deleted, in batches (dedup.Store.GC,
// outbox.Outbox.GC). Several workers may run it: each round of the keys
// takes the schema's GC lease, and a round that finds it taken is skipped.
type GC struct {
	// Every is the interval between rounds (required, positive).
	Every time.Duration
	// Keys are the key store's options; zero Retention: the store's.
	Keys dedup.GCOptions
	// Outbox are the outbox's options; zero Retention: dedup.DefaultRetention.
	Outbox dedup.GCOptions
}

// Worker is a consumer, its outbox relay and retention, run together.
type Worker struct {
	consumer *consumer.Consumer
	outbox   *outbox.Outbox
	relay    *outbox.Relay
	store    *dedup.Store
	cfg      Config
	log      *slog.Logger
}

// New returns the worker cfg describes, with h handling the consumer's
// deliveries. It checks both configurations; it connects to nothing.
func New(store *dedup.Store, h consumer.Handler, cfg *Config) (*Worker, error) {
	if cfg == nil {
		return nil, errors.New("worker: nil config")
	}
	c := *cfg
	if c.GC != nil && c.GC.Every <= 0 {
		return nil, fmt.Errorf("worker: GC.Every %s must be positive", c.GC.Every)
	}
	if c.DrainTimeout < 0 {
		return nil, fmt.Errorf("worker: DrainTimeout %s is negative", c.DrainTimeout)
	}
	c.DrainTimeout = cmp.Or(c.DrainTimeout, DefaultDrainTimeout)
	cons, err := consumer.New(store, h, &c.Consumer)
	if err != nil {
		return nil, fmt.Errorf("worker: %w", err)
	}
	w := &Worker{consumer: cons, store: store, cfg: c, log: cmp.Or(c.Consumer.Logger, slog.Default())}
	if w.outbox, err = outbox.New(store.Pool(), &outbox.Config{
		Schema: store.Config().Schema, Propagator: c.Consumer.Propagator, MeterProvider: c.Consumer.MeterProvider,
	}); err != nil {
		return nil, fmt.Errorf("worker: %w", err)
	}
	if !c.NoRelay {
		rc := c.Relay
		rc.TracerProvider = cmp.Or(rc.TracerProvider, c.Consumer.TracerProvider)
		rc.MeterProvider = cmp.Or(rc.MeterProvider, c.Consumer.MeterProvider)
		rc.Propagator = cmp.Or(rc.Propagator, c.Consumer.Propagator)
		rc.Logger = cmp.Or(rc.Logger, c.Consumer.Logger)
		if rc.ConnectionName == "" && c.Consumer.ConnectionName != "" {
			rc.ConnectionName = c.Consumer.ConnectionName + "-relay"
		}
		if rc.Dial == nil && c.Consumer.AMQPConfig != nil {
			addrs, err := amqpdial.Parse(c.Consumer.URL)
			if err != nil {
				return nil, fmt.Errorf("worker: relay broker: %w", err)
			}
			d := &amqpdial.Dialer{Addrs: addrs, Name: cmp.Or(rc.ConnectionName, outbox.DefaultConnectionName),
				Config: c.Consumer.AMQPConfig, Timeout: c.Consumer.DialTimeout}
			rc.Dial = d.Dial
		}
		if w.relay, err = outbox.NewRelay(w.outbox, c.Consumer.URL, &rc); err != nil {
			return nil, fmt.Errorf("worker: %w", err)
		}
	}
	return w, nil
}

// Consumer returns the worker's consumer (its Ready, its Stats).
func (w *Worker) Consumer() *consumer.Consumer { return w.consumer }

// Outbox returns the outbox the worker's handlers enqueue to.
func (w *Worker) Outbox() *outbox.Outbox { return w.outbox }

// Run runs the relay, the consumer and retention until ctx ends or one of
// the first two fails (see the package documentation), and returns the
// first error (nil after a clean stop).
func (w *Worker) Run(ctx context.Context) error {
	if w.relay == nil {
		return w.runConsumer(ctx)
	}
	return w.relay.RunBeside(ctx, w.cfg.DrainTimeout, w.runConsumer)
}

// runConsumer runs the consumer, and retention beside it, until ctx ends.
func (w *Worker) runConsumer(ctx context.Context) error {
	gcCtx, stopGC := context.WithCancel(ctx)
	var gcDone sync.WaitGroup
	if w.cfg.GC != nil {
		gcDone.Go(func() { w.runGC(gcCtx) })
	}
	err := w.consumer.Run(ctx)
	stopGC()
	gcDone.Wait()
	return err
}

// runGC runs a retention round every GC.Every until ctx ends.
func (w *Worker) runGC(ctx context.Context) {
	tick := time.NewTicker(w.cfg.GC.Every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if _, err := w.store.GC(ctx, w.cfg.GC.Keys); err != nil && ctx.Err() == nil {
			w.log.Warn("key retention failed; trying again at the next round", "err", redact.Error(err))
		}
		if _, err := w.outbox.GC(ctx, w.cfg.GC.Outbox); err != nil && ctx.Err() == nil {
			w.log.Warn("outbox retention failed; trying again at the next round", "err", redact.Error(err))
		}
	}
}
