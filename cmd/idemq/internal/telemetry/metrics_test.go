package telemetry_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/idemq/idemq/cmd/idemq/internal/telemetry"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/outbox"
)

// TestMetrics runs a consumer and an outbox relay with the meter provider
// of telemetry.Setup and reads their metrics from its /metrics endpoint, as
// Prometheus would; then checks that the Grafana dashboard asks for metric
// names that exist.
func TestMetrics(t *testing.T) {
	t.Parallel()
	e := testenv.New(t)
	service := "idemq-it-metrics-" + testdb.RandomHex(4)
	tel := setup(t, telemetry.Options{ServiceName: service, MetricsAddr: "127.0.0.1:0"})
	scrape := func() map[string]*dto.MetricFamily { return scrapeMetrics(t, "http://"+tel.MetricsAddr()+"/metrics") }

	cfg, events := e.ConsumerConfig("it.metrics", "metered")
	cfg.MeterProvider = tel.MeterProvider()
	sink := testamqp.Name(t, "it.metrics.sink")
	testamqp.DeleteQueuesAtCleanup(t, []string{sink}, nil)
	if _, err := e.Pub.QueueDeclare(sink, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	missing := testamqp.Name(t, "it.metrics.missing-exchange")
	ob, err := outbox.New(e.Pool, &outbox.Config{Schema: e.Schema})
	if err != nil {
		t.Fatal(err)
	}
	// Every processed message enqueues two outbox messages: one the relay
	// publishes, one to an exchange that does not exist, which stays pending.
	e.Run(cfg, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		switch {
		case strings.HasPrefix(d.Key, "perm-"):
			return consumer.Response{}, consumer.Permanent(errors.New("undecodable"))
		case strings.HasPrefix(d.Key, "flaky-") && d.Attempt == 1:
			return consumer.Response{}, errors.New("database briefly down")
		}
		if err := ob.Enqueue(ctx, tx, outbox.Message{RoutingKey: sink, Body: d.Body}); err != nil {
			return consumer.Response{}, err
		}
		return consumer.Response{}, ob.Enqueue(ctx, tx, outbox.Message{Exchange: missing, Body: d.Body})
	})
	relayConn := "idemq-test-relay-" + e.Schema
	relay, err := outbox.NewRelay(ob, testamqp.URL(), &outbox.RelayConfig{
		MeterProvider: tel.MeterProvider(), PollInterval: 100 * time.Millisecond,
		ConnectionName: relayConn, RetryInitial: 10 * time.Minute, RetryMax: 10 * time.Minute, Logger: cfg.Logger,
	})
	if err != nil {
		t.Fatal(err)
	}
	e.RunFunc(relay.Run)

	for _, key := range []string{"ok-1", "ok-2", "ok-3", "perm-1", "flaky-1", ""} {
		e.Publish(cfg.Queue, key, `{"n":1}`, nil)
	}
	got := map[consumer.Outcome]int{}
	for range 7 { // 3 ok, 1 permanent, flaky retried then processed, no key
		got[testenv.WaitEvent(t, events).Outcome]++
	}
	e.Publish(cfg.Queue, "ok-1", `{"n":1}`, nil)
	testenv.WaitOutcome(t, events, consumer.OutcomeDuplicate)
	want := map[consumer.Outcome]int{
		consumer.OutcomeProcessed: 4, consumer.OutcomeDeadLettered: 1, consumer.OutcomeRetried: 1, consumer.OutcomeInvalidKey: 1,
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("outcomes %v, want %v", got, want)
	}

	queue := map[string]string{"idemq_queue": cfg.Queue, "idemq_consumer": "metered"}
	with := func(kv ...string) map[string]string {
		m := map[string]string{}
		for k, v := range queue {
			m[k] = v
		}
		for i := 0; i+1 < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	fams := scrape()
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"idemq_consumer_deliveries_total", with("outcome", "processed"), 4},
		{"idemq_consumer_deliveries_total", with("outcome", "duplicate"), 1},
		{"idemq_consumer_deliveries_total", with("outcome", "dead_lettered"), 1},
		{"idemq_consumer_deliveries_total", with("outcome", "retried"), 1},
		{"idemq_consumer_deliveries_total", with("outcome", "invalid_key"), 1},
		{"idemq_consumer_dead_letters_total", with("reason", "permanent_error"), 1},
		{"idemq_consumer_dead_letters_total", with("reason", "idempotency_key_required"), 1},
		{"idemq_consumer_retries_total", queue, 1},
		{"idemq_consumer_keys_in_progress", queue, 0},
	} {
		if v, ok := sampleValue(fams, c.name, c.labels); !ok || v != c.want {
			t.Errorf("%s%v = %v (present %v), want %v", c.name, c.labels, v, ok, c.want)
		}
	}
	// One handler observation per run (4 successes, the flaky failure, the
	// permanent one) and one reserve per keyed delivery (those plus the
	// duplicate): fewer when deliveries were handled in groups, one
	// observation per group then.
	for name, most := range map[string]uint64{
		"idemq_consumer_handler_duration_seconds": 6,
		"idemq_consumer_reserve_duration_seconds": 7,
	} {
		h, ok := histogram(fams, name, queue)
		if !ok || h.GetSampleCount() < 1 || h.GetSampleCount() > most || h.GetSampleSum() <= 0 {
			t.Errorf("%s%v: %d observations summing to %gs (present %v), want 1 to %d", name, queue, h.GetSampleCount(), h.GetSampleSum(), ok, most)
			continue
		}
		var bounds []float64
		for _, b := range h.GetBucket() {
			if !math.IsInf(b.GetUpperBound(), 1) {
				bounds = append(bounds, b.GetUpperBound())
			}
		}
		if !slices.Equal(bounds, telemetry.SecondsBuckets) {
			t.Errorf("%s buckets %v, want %v", name, bounds, telemetry.SecondsBuckets)
		}
	}
	if v, ok := sampleValue(fams, "target_info", map[string]string{"service_name": service}); !ok || v != 1 {
		t.Errorf("target_info{service_name=%q} missing", service)
	}

	// Reconnects: the broker closes the consumer's and the relay's connections.
	if n := testamqp.CloseConnections(t, cfg.ConnectionName) + testamqp.CloseConnections(t, relayConn); n < 2 {
		t.Fatalf("closed %d connections, want the consumer's and the relay's", n)
	}
	outboxLabels := map[string]string{"idemq_schema": e.Schema}
	testenv.Poll(t, 60*time.Second, func(context.Context) bool {
		fams = scrape()
		c, _ := sampleValue(fams, "idemq_consumer_reconnects_total", queue)
		r, _ := sampleValue(fams, "idemq_outbox_reconnects_total", outboxLabels)
		return c >= 1 && r >= 1
	}, func() string { return "no reconnect counted for the consumer and the relay" })
	e.Publish(cfg.Queue, "ok-4", `{"n":1}`, nil)
	testenv.WaitOutcome(t, events, consumer.OutcomeProcessed)

	// The outbox: 5 messages published, 5 pending (their exchange is missing).
	testenv.Poll(t, 60*time.Second, func(context.Context) bool {
		fams = scrape()
		pub, _ := sampleValue(fams, "idemq_outbox_published_total", outboxLabels)
		pending, _ := sampleValue(fams, "idemq_outbox_pending", outboxLabels)
		age, _ := sampleValue(fams, "idemq_outbox_oldest_age_seconds", outboxLabels)
		returned, _ := sampleValue(fams, "idemq_outbox_returned_total", outboxLabels)
		lag, _ := histogram(fams, "idemq_outbox_lag_seconds", outboxLabels)
		return pub == 5 && pending == 5 && age > 0 && returned >= 5 && lag.GetSampleCount() == 5
	}, func() string {
		var lines []string
		for name, f := range fams {
			if strings.HasPrefix(name, "idemq_outbox") {
				lines = append(lines, fmt.Sprintf("%s %v", name, f.GetMetric()))
			}
		}
		sort.Strings(lines)
		return "outbox metrics:\n" + strings.Join(lines, "\n")
	})

	// Every idemq metric of the Grafana dashboard is one this process exports.
	for _, name := range dashboardMetrics(t) {
		if _, ok := fams[name]; !ok {
			t.Errorf("deploy/grafana/idemq-dashboard.json uses %s, which /metrics does not export", name)
		}
	}
}

func scrapeMetrics(tb testing.TB, url string) map[string]*dto.MetricFamily {
	tb.Helper()
	resp, err := http.Get(url)
	if err != nil {
		tb.Fatalf("scrape: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		tb.Fatalf("scrape: %s", resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		tb.Fatalf("scrape: parse: %v", err)
	}
	return fams
}

// find returns the sample of family name whose labels include want.
func find(fams map[string]*dto.MetricFamily, name string, want map[string]string) (*dto.Metric, bool) {
	f, ok := fams[name]
	if !ok {
		return nil, false
	}
	for _, m := range f.GetMetric() {
		labels := map[string]string{}
		for _, l := range m.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		match := true
		for k, v := range want {
			if labels[k] != v {
				match = false
			}
		}
		if match {
			return m, true
		}
	}
	return nil, false
}

func sampleValue(fams map[string]*dto.MetricFamily, name string, labels map[string]string) (float64, bool) {
	m, ok := find(fams, name, labels)
	switch {
	case !ok:
		return 0, false
	case m.Counter != nil:
		return m.Counter.GetValue(), true
	case m.Gauge != nil:
		return m.Gauge.GetValue(), true
	}
	return 0, false
}

func histogram(fams map[string]*dto.MetricFamily, name string, labels map[string]string) (*dto.Histogram, bool) {
	m, ok := find(fams, name, labels)
	if !ok || m.Histogram == nil {
		return nil, false
	}
	return m.Histogram, true
}

// promName matches a metric selector (labels are followed by = or by a comma or parenthesis).
var promName = regexp.MustCompile(`\bidemq_[a-z0-9_]+(?:\{|\[)`)

// dashboardMetrics returns the metric families the dashboard's queries use
// (histogram series _bucket, _sum and _count folded into their family).
func dashboardMetrics(tb testing.TB) []string {
	tb.Helper()
	raw, err := os.ReadFile("../../../../deploy/grafana/idemq-dashboard.json")
	if err != nil {
		tb.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		tb.Fatalf("dashboard is not valid JSON: %v", err)
	}
	seen := map[string]bool{}
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			for _, n := range promName.FindAllString(tg.Expr, -1) {
				n = strings.TrimRight(n, "{[")
				for _, suffix := range []string{"_bucket", "_count", "_sum"} {
					if strings.HasSuffix(n, "_seconds"+suffix) {
						n = strings.TrimSuffix(n, suffix)
					}
				}
				seen[n] = true
			}
		}
	}
	if len(seen) == 0 {
		tb.Fatal("the dashboard queries no idemq metric")
	}
	out := make([]string, 0, len(seen))
	for n := range seen {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}
