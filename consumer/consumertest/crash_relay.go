package consumertest

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/internal/relaykit"
	"github.com/idemq/idemq/outbox"
)

// downstreamURL is the broker the Downstream's relay publishes to.
func (k *pointRun) downstreamURL() string { return cmp.Or(k.subject.Downstream.URL, k.cfg.URL) }

// relay publishes the outbox's rows with a real relay until none is
// pending (the first relay dying after its confirms when crash is set),
// and returns the messages that arrived downstream.
func (k *pointRun) relay(crash bool) ([]amqp.Delivery, error) {
	d := k.subject.Downstream
	if crash {
		died, err := k.runRelay(true)
		if err != nil {
			return nil, err
		}
		k.mu.Lock()
		k.row.Reached = died
		k.mu.Unlock()
	}
	if _, err := k.runRelay(false); err != nil {
		return nil, err
	}
	conn, err := dialKit(k.downstreamURL(), "consumertest-downstream", nil)
	if err != nil {
		return nil, fmt.Errorf("downstream: dial: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("downstream: channel: %w", err)
	}
	// Every row is marked, so each message was confirmed: it is in the
	// queue already.
	var msgs []amqp.Delivery
	for {
		m, ok, err := ch.Get(d.Queue, true)
		if err != nil {
			return nil, fmt.Errorf("downstream: get from %q: %w", d.Queue, err)
		}
		if !ok {
			return msgs, nil
		}
		msgs = append(msgs, m)
	}
}

// runRelay runs one relay on the Subject's outbox until no row is pending
// or, with crash, until it died after the confirms of its first batch (it
// reports whether it did).
func (k *pointRun) runRelay(crash bool) (died bool, err error) {
	r, err := outbox.NewRelay(k.outbox, k.downstreamURL(), &outbox.RelayConfig{
		ConnectionName: "consumertest-relay", Lanes: 1, PollInterval: 20 * time.Millisecond,
		RetryInitial: 20 * time.Millisecond, Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		return false, fmt.Errorf("relay: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var crashed atomic.Bool
	if crash {
		relaykit.SetAfterConfirm(r, func(context.Context) bool {
			if crashed.Swap(true) {
				return false
			}
			cancel()
			return true
		})
	}
	ran := make(chan error, 1)
	go func() { ran <- r.Run(ctx) }()
	deadline := time.Now().Add(crashWait)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case err := <-ran:
			if crashed.Load() {
				return true, nil
			}
			return false, fmt.Errorf("the relay stopped: %v", err)
		case <-tick.C:
		}
		b, err := k.outbox.Pending(context.Background())
		if err != nil {
			cancel()
			<-ran
			return false, err
		}
		if b.Pending == 0 {
			cancel()
			<-ran
			return crashed.Load(), nil
		}
		if time.Now().After(deadline) {
			cancel()
			<-ran
			return false, fmt.Errorf("%d outbox rows still pending after %s", b.Pending, crashWait)
		}
	}
}

// relayTraces names the crashed relay's attempt by the traces of the
// messages it published (each row's, as the handler enqueued it).
func (k *pointRun) relayTraces(msgs []amqp.Delivery) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if !k.row.Reached {
		return
	}
	for _, m := range msgs {
		carrier := propagation.MapCarrier{}
		for key, v := range m.Headers {
			if s, ok := v.(string); ok {
				carrier[key] = s
			}
		}
		sc := trace.SpanContextFromContext(k.prop.Extract(context.Background(), carrier))
		if tid := sc.TraceID().String(); sc.IsValid() && !slices.Contains(k.row.TraceIDs, tid) {
			k.row.TraceIDs = append(k.row.TraceIDs, tid)
		}
	}
}
