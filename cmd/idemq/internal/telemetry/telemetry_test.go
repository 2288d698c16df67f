package telemetry_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/cmd/idemq/internal/telemetry"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// otelVars are every variable Setup reads; each test starts with them unset.
var otelVars = []string{
	"OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER",
	"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
	"OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
	"OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG",
	"OTEL_EXPORTER_PROMETHEUS_HOST", "OTEL_EXPORTER_PROMETHEUS_PORT",
}

func cleanEnv(t *testing.T, set map[string]string) {
	t.Helper()
	for _, v := range otelVars {
		t.Setenv(v, "")
	}
	for k, v := range set {
		t.Setenv(k, v)
	}
}

func setup(t *testing.T, opts telemetry.Options) *telemetry.Telemetry {
	t.Helper()
	opts.NoGlobal = true
	tel, err := telemetry.Setup(context.Background(), opts)
	if err != nil {
		t.Fatalf("setup: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := tel.Shutdown(ctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
	})
	return tel
}

func TestOffByDefault(t *testing.T) {
	cleanEnv(t, nil)
	tel := setup(t, telemetry.Options{ServiceName: "svc"})
	if tel.TracingEnabled() {
		t.Fatal("tracing on without any OTEL_* variable")
	}
	_, span := tel.TracerProvider().Tracer("t").Start(context.Background(), "op")
	if span.IsRecording() || span.SpanContext().IsValid() {
		t.Fatal("span of the disabled provider records")
	}
	span.End()
	if tel.MetricsAddr() != "" || tel.MetricsHandler() != nil {
		t.Fatal("metrics served without MetricsAddr")
	}
}

// collector is an OTLP/HTTP endpoint that counts the requests per path.
type collector struct {
	srv     *httptest.Server
	traces  atomic.Int64
	metrics atomic.Int64
	others  atomic.Int64
}

func newCollector(t *testing.T) *collector {
	c := &collector{}
	c.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		switch {
		case r.Header.Get("Content-Type") != "application/x-protobuf":
			c.others.Add(1)
		case r.URL.Path == "/v1/traces":
			c.traces.Add(1)
		case r.URL.Path == "/v1/metrics":
			c.metrics.Add(1)
		default:
			c.others.Add(1)
		}
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(c.srv.Close)
	return c
}

func TestTracesOverHTTPProtobuf(t *testing.T) {
	col := newCollector(t)
	cleanEnv(t, map[string]string{
		"OTEL_EXPORTER_OTLP_ENDPOINT": col.srv.URL,
		"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
		"OTEL_SERVICE_NAME":           "from-env",
		"OTEL_RESOURCE_ATTRIBUTES":    "deployment.environment.name=test,service.name=overridden",
	})
	tel := setup(t, telemetry.Options{ServiceName: "from-options", ServiceVersion: "1.2.3"})
	if !tel.TracingEnabled() {
		t.Fatal("tracing off although OTEL_EXPORTER_OTLP_ENDPOINT is set")
	}
	res := map[string]string{}
	for _, kv := range tel.Resource().Attributes() {
		res[string(kv.Key)] = kv.Value.String()
	}
	for k, want := range map[string]string{
		"service.name": "from-env", "service.version": "1.2.3", "deployment.environment.name": "test",
		"telemetry.sdk.language": "go",
	} {
		if res[k] != want {
			t.Errorf("resource %s = %q, want %q (all: %v)", k, res[k], want, res)
		}
	}
	_, span := tel.TracerProvider().Tracer("t").Start(context.Background(), "op")
	if !span.IsRecording() || !span.SpanContext().IsSampled() {
		t.Fatal("span not recorded and sampled by default")
	}
	span.End()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := tel.ForceFlush(ctx); err != nil {
		t.Fatalf("flush: %v", err)
	}
	if col.traces.Load() != 1 || col.others.Load() != 0 {
		t.Fatalf("collector got %d trace exports and %d other requests, want 1 and 0", col.traces.Load(), col.others.Load())
	}
}

func TestMetricsOverOTLP(t *testing.T) {
	col := newCollector(t)
	cleanEnv(t, map[string]string{
		"OTEL_METRICS_EXPORTER":               "otlp",
		"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": col.srv.URL + "/v1/metrics",
		"OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
	})
	tel := setup(t, telemetry.Options{})
	if tel.TracingEnabled() || tel.MetricsAddr() != "" {
		t.Fatal("OTEL_METRICS_EXPORTER=otlp turned tracing or the Prometheus server on")
	}
	c, err := tel.MeterProvider().Meter("test").Int64Counter("idemq.test.things")
	if err != nil {
		t.Fatal(err)
	}
	c.Add(context.Background(), 1)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := tel.ForceFlush(ctx); err != nil {
		t.Fatalf("flush: %v", err)
	}
	if col.metrics.Load() < 1 || col.others.Load() != 0 || col.traces.Load() != 0 {
		t.Fatalf("collector got %d metric exports, %d trace exports, %d others; want >=1, 0, 0",
			col.metrics.Load(), col.traces.Load(), col.others.Load())
	}
}

func TestTracesExporterVariables(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  map[string]string
		on   bool
	}{
		{"traces endpoint", map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1"}, true},
		{"exporter otlp, default endpoint", map[string]string{"OTEL_TRACES_EXPORTER": "otlp"}, true},
		{"exporter none wins", map[string]string{"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}, false},
		{"sdk disabled wins", map[string]string{"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, false},
		{"grpc explicit", map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cleanEnv(t, tc.env)
			tel := setup(t, telemetry.Options{})
			if tel.TracingEnabled() != tc.on {
				t.Fatalf("tracing enabled = %v, want %v", tel.TracingEnabled(), tc.on)
			}
		})
	}
}

func TestSamplerFromEnvironment(t *testing.T) {
	cleanEnv(t, map[string]string{
		"OTEL_TRACES_EXPORTER":    "otlp",
		"OTEL_TRACES_SAMPLER":     "traceidratio",
		"OTEL_TRACES_SAMPLER_ARG": "0",
	})
	tel := setup(t, telemetry.Options{})
	for range 50 {
		_, span := tel.TracerProvider().Tracer("t").Start(context.Background(), "op")
		if span.SpanContext().IsSampled() {
			t.Fatal("span sampled with OTEL_TRACES_SAMPLER=traceidratio and ratio 0")
		}
		span.End()
	}
}

func TestInvalidVariables(t *testing.T) {
	for _, env := range []map[string]string{
		{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
		{"OTEL_TRACES_EXPORTER": "zipkin"},
		{"OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "udp"},
		{"OTEL_METRICS_EXPORTER": "statsd"},
	} {
		cleanEnv(t, env)
		if tel, err := telemetry.Setup(context.Background(), telemetry.Options{NoGlobal: true}); err == nil {
			_ = tel.Shutdown(context.Background())
			t.Errorf("Setup accepted %v", env)
		} else if !strings.HasPrefix(err.Error(), "telemetry: OTEL_") {
			t.Errorf("error %q does not name the variable", err)
		}
	}
}

func TestPrometheusEndpoint(t *testing.T) {
	cleanEnv(t, map[string]string{"OTEL_SERVICE_NAME": "prom-test"})
	tel := setup(t, telemetry.Options{MetricsAddr: "127.0.0.1:0"})
	if tel.TracingEnabled() {
		t.Fatal("metrics turned tracing on")
	}
	m := tel.MeterProvider().Meter("test")
	c, err := m.Int64Counter("idemq.test.things", metric.WithUnit("{thing}"))
	if err != nil {
		t.Fatal(err)
	}
	c.Add(context.Background(), 3)
	h, err := m.Float64Histogram("idemq.test.duration", metric.WithUnit("s"))
	if err != nil {
		t.Fatal(err)
	}
	h.Record(context.Background(), 0.003)

	body := get(t, "http://"+tel.MetricsAddr()+"/metrics")
	for _, want := range []string{
		"idemq_test_things_total{",
		`idemq_test_duration_seconds_bucket{otel_scope_name="test",otel_scope_schema_url="",otel_scope_version="",le="0.005"} 1`,
		`idemq_test_duration_seconds_bucket{otel_scope_name="test",otel_scope_schema_url="",otel_scope_version="",le="0.0025"} 0`,
		`target_info{`, `service_name="prom-test"`,
		"go_goroutines ",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %q:\n%s", want, body)
		}
	}
	if got := get(t, "http://"+tel.MetricsAddr()+"/healthz"); got != "ok\n" {
		t.Errorf("/healthz = %q", got)
	}
	addr := tel.MetricsAddr()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := tel.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if err := tel.Shutdown(ctx); err != nil {
		t.Fatalf("second shutdown: %v", err)
	}
	if _, err := http.Get("http://" + addr + "/healthz"); err == nil {
		t.Fatal("metrics server still answers after Shutdown")
	}
}

func TestMetricsAddrInUse(t *testing.T) {
	cleanEnv(t, nil)
	tel := setup(t, telemetry.Options{MetricsAddr: "127.0.0.1:0"})
	if _, err := telemetry.Setup(context.Background(), telemetry.Options{MetricsAddr: tel.MetricsAddr(), NoGlobal: true}); err == nil {
		t.Fatal("second Setup on the same address succeeded")
	}
}

func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s", url, resp.Status)
	}
	return string(b)
}
