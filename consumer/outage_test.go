package consumer_test

import (
	"context"
	"regexp"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/internal/testamqp"
)

// TestBrokerOutageIsLoggedOnce: the broker goes out of reach under a
// consuming consumer (its connection cut, its reconnects refused) while it
// retries several times; the outage is one WARN line when it starts, none
// while it lasts (shorter than the interval), and one INFO line when it
// ends, with its duration; then the consumer consumes again.
func TestBrokerOutageIsLoggedOnce(t *testing.T) {
	t.Parallel()
	p := testamqp.NewProxy(t)
	logs := &logRecords{}
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	h := newHarness(t, modeSingle, func(c *consumer.Config) {
		c.URL = p.URL
		c.Logger = logs.logger()
		c.MeterProvider = mp
	})
	h.start(1, h.ledgerEffect)
	h.publish("before-the-outage", `{"n":1}`, nil)
	h.waitEvents(30*time.Second, "the first message processed", func(evs []consumer.Event) bool {
		return countOutcomes(evs)[consumer.OutcomeProcessed] >= 1
	})

	p.Cut()
	consumertest.WaitFor(t, 30*time.Second, "4 reconnect attempts", func() bool { return reconnects(t, reader) >= 4 })
	p.Restore(t)
	h.publish("after-the-outage", `{"n":2}`, nil)
	h.waitEvents(30*time.Second, "the second message processed", func(evs []consumer.Event) bool {
		return countOutcomes(evs)[consumer.OutcomeProcessed] >= 2
	})
	consumertest.WaitFor(t, 10*time.Second, "the recovery line", func() bool { return len(logs.find("consumer connection recovered")) > 0 })

	starts := len(logs.find("broker connection lost; reconnecting")) + len(logs.find("cannot start consuming (never connected yet); retrying"))
	if still := logs.find("consumer connection still down"); starts != 1 || len(still) != 0 {
		t.Errorf("%d lines start the outage, %d say it goes on; want 1 and 0:%s", starts, len(still), logs.all())
	}
	rec := logs.find("consumer connection recovered")
	if len(rec) != 1 || rec[0].level.String() != "INFO" || !regexp.MustCompile(`^[0-9.]+(ms|s)$`).MatchString(rec[0].attrs["after"]) || rec[0].attrs["failures"] == "" {
		t.Errorf("want one INFO line of the recovery with its duration and failures:%s", logs.all())
	}
}

// reconnects reads the consumer's reconnect counter.
func reconnects(t *testing.T, reader *sdkmetric.ManualReader) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if sum, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == "idemq.consumer.reconnects" {
				for _, dp := range sum.DataPoints {
					n += dp.Value
				}
			}
		}
	}
	return n
}
