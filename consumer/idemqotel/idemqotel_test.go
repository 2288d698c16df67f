package idemqotel_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/consumer/idemqotel"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// otelVars are the variables Setup and the exporters read; each test starts
// with them unset.
var otelVars = []string{
	"OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_METRICS_PRODUCERS",
	"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
	"OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
	"OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_EXPORTER_PROMETHEUS_HOST", "OTEL_EXPORTER_PROMETHEUS_PORT",
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

func setup(t *testing.T, opts idemqotel.Options) *idemqotel.Telemetry {
	t.Helper()
	opts.NoGlobal = true
	tel, err := idemqotel.Setup(context.Background(), opts)
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

// A library user's defaults: no span export, a Prometheus exposition and a
// health check on the handler to mount.
func TestDefaultsServeMetricsAndHealth(t *testing.T) {
	cleanEnv(t, map[string]string{"OTEL_SERVICE_NAME": "payments"})
	var notReady atomic.Pointer[error]
	tel := setup(t, idemqotel.Options{Ready: func() error {
		if err := notReady.Load(); err != nil {
			return *err
		}
		return nil
	}})
	if tel.TracingEnabled() || tel.MetricsAddr() != "" {
		t.Fatalf("tracing %v, server %q without any variable or Addr", tel.TracingEnabled(), tel.MetricsAddr())
	}
	srv := httptest.NewServer(tel.Handler())
	t.Cleanup(srv.Close)
	c, err := tel.MeterProvider().Meter("test").Int64Counter("idemq.test.things", metric.WithUnit("{thing}"))
	if err != nil {
		t.Fatal(err)
	}
	c.Add(context.Background(), 2)
	h, err := tel.MeterProvider().Meter("test").Float64Histogram("idemq.test.duration", metric.WithUnit("s"))
	if err != nil {
		t.Fatal(err)
	}
	h.Record(context.Background(), 0.003)
	code, body := get(t, srv.URL+"/metrics")
	for _, want := range []string{
		"idemq_test_things_total{", `le="0.005"} 1`, `le="0.0025"} 0`,
		`target_info{`, `service_name="payments"`, "go_goroutines ", "process_",
	} {
		if code != http.StatusOK || !strings.Contains(body, want) {
			t.Errorf("/metrics %d lacks %q:\n%s", code, want, body)
		}
	}
	if code, body := get(t, srv.URL+"/healthz"); code != http.StatusOK || body != "ok\n" {
		t.Errorf("/healthz = %d %q while ready", code, body)
	}
	down := errors.New("consumer reconnecting")
	notReady.Store(&down)
	if code, body := get(t, srv.URL+"/healthz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "consumer reconnecting") {
		t.Errorf("/healthz = %d %q while not ready, want 503 with the reason", code, body)
	}
}

func TestNoPrometheusAndNoPushIsNoMetrics(t *testing.T) {
	cleanEnv(t, nil)
	tel := setup(t, idemqotel.Options{NoPrometheus: true})
	if tel.MetricsHandler() != nil || tel.Resource() != nil {
		t.Fatal("metrics set up with NoPrometheus and no exporter")
	}
	srv := httptest.NewServer(tel.Handler())
	t.Cleanup(srv.Close)
	if code, _ := get(t, srv.URL+"/metrics"); code != http.StatusNotFound {
		t.Errorf("/metrics = %d with NoPrometheus, want 404", code)
	}
}

// OTEL_METRICS_EXPORTER=prometheus serves the exposition where the
// specification's variables say, on Setup's own server.
func TestPrometheusFromTheEnvironment(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	ln.Close()
	cleanEnv(t, map[string]string{
		"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1", "OTEL_EXPORTER_PROMETHEUS_PORT": port,
	})
	tel := setup(t, idemqotel.Options{NoPrometheus: true})
	if tel.MetricsAddr() != "127.0.0.1:"+port {
		t.Fatalf("serving on %q, want 127.0.0.1:%s", tel.MetricsAddr(), port)
	}
	if code, body := get(t, "http://"+tel.MetricsAddr()+"/metrics"); code != http.StatusOK || !strings.Contains(body, "target_info") {
		t.Fatalf("/metrics = %d:\n%s", code, body)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := tel.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := http.Get("http://" + tel.MetricsAddr() + "/healthz"); err == nil {
		t.Fatal("server still answers after Shutdown")
	}
}

// collector is an OTLP/HTTP endpoint that counts the requests per path.
type collector struct {
	srv             *httptest.Server
	traces, metrics atomic.Int64
}

func newCollector(t *testing.T) *collector {
	c := &collector{}
	c.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		switch r.URL.Path {
		case "/v1/traces":
			c.traces.Add(1)
		case "/v1/metrics":
			c.metrics.Add(1)
		}
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(c.srv.Close)
	return c
}

// An endpoint alone turns tracing on, over http/protobuf (the
// specification's default protocol) unless Options.OTLPProtocol says grpc.
func TestEndpointTurnsTracingOnOverHTTP(t *testing.T) {
	col := newCollector(t)
	cleanEnv(t, map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": col.srv.URL, "OTEL_METRICS_EXPORTER": "otlp"})
	tel := setup(t, idemqotel.Options{ServiceName: "payments"})
	if !tel.TracingEnabled() {
		t.Fatal("tracing off with OTEL_EXPORTER_OTLP_ENDPOINT set")
	}
	_, span := tel.TracerProvider().Tracer("t").Start(context.Background(), "op")
	span.End()
	c, _ := tel.MeterProvider().Meter("test").Int64Counter("idemq.test.things")
	c.Add(context.Background(), 1)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := tel.ForceFlush(ctx); err != nil {
		t.Fatalf("flush: %v", err)
	}
	if col.traces.Load() != 1 || col.metrics.Load() < 1 {
		t.Fatalf("collector got %d trace and %d metric exports, want 1 and at least 1", col.traces.Load(), col.metrics.Load())
	}
}

func TestTracesExporterVariables(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  map[string]string
		on   bool
	}{
		{"nothing set", nil, false},
		{"traces endpoint", map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1"}, true},
		{"exporter otlp, default endpoint", map[string]string{"OTEL_TRACES_EXPORTER": "otlp"}, true},
		{"exporter console", map[string]string{"OTEL_TRACES_EXPORTER": "console"}, true},
		{"exporter none wins", map[string]string{"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}, false},
		{"sdk disabled wins", map[string]string{"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cleanEnv(t, tc.env)
			tel := setup(t, idemqotel.Options{OTLPProtocol: idemqotel.ProtocolGRPC})
			if tel.TracingEnabled() != tc.on {
				t.Fatalf("tracing enabled = %v, want %v", tel.TracingEnabled(), tc.on)
			}
		})
	}
}

func TestInvalidValuesNameTheVariable(t *testing.T) {
	for _, tc := range []struct {
		env  map[string]string
		name string
	}{
		{map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"},
		{map[string]string{"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"},
		{map[string]string{"OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "udp"}, "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"},
		{map[string]string{"OTEL_METRICS_EXPORTER": "statsd"}, "OTEL_METRICS_EXPORTER"},
	} {
		cleanEnv(t, tc.env)
		tel, err := idemqotel.Setup(context.Background(), idemqotel.Options{NoGlobal: true})
		if err == nil {
			_ = tel.Shutdown(context.Background())
			t.Errorf("Setup accepted %v", tc.env)
		} else if !strings.Contains(err.Error(), tc.name) {
			t.Errorf("error %q does not name %s", err, tc.name)
		}
	}
	cleanEnv(t, nil)
	if _, err := idemqotel.Setup(context.Background(), idemqotel.Options{OTLPProtocol: "udp", NoGlobal: true}); err == nil {
		t.Error("Setup accepted OTLPProtocol udp")
	}
}

// Without NoGlobal, Setup installs the W3C propagator and its providers
// as the otel globals, which configs left nil use.
func TestSetupInstallsTheGlobals(t *testing.T) {
	cleanEnv(t, map[string]string{"OTEL_TRACES_EXPORTER": "console"})
	tel, err := idemqotel.Setup(context.Background(), idemqotel.Options{NoPrometheus: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tel.Shutdown(context.Background()) })
	if f := otel.GetTextMapPropagator().Fields(); !slices.Contains(f, "traceparent") || !slices.Contains(f, "baggage") {
		t.Errorf("global propagator fields %v, want W3C trace context and baggage", f)
	}
	if otel.GetTracerProvider() != tel.TracerProvider() {
		t.Error("the global tracer provider is not Setup's")
	}
}

func TestAddrInUse(t *testing.T) {
	cleanEnv(t, nil)
	tel := setup(t, idemqotel.Options{Addr: "127.0.0.1:0"})
	if _, err := idemqotel.Setup(context.Background(), idemqotel.Options{Addr: tel.MetricsAddr(), NoGlobal: true}); err == nil {
		t.Fatal("second Setup on the same address succeeded")
	}
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// The server on Addr answers only to the names it may be reached at: a web
// page whose name is rebound to 127.0.0.1 gets 421, not the metrics.
func TestAddrRefusesOtherHosts(t *testing.T) {
	cleanEnv(t, nil)
	tel := setup(t, idemqotel.Options{Addr: "127.0.0.1:0", AllowHosts: []string{"metrics.internal"}})
	for host, want := range map[string]int{
		tel.MetricsAddr():         http.StatusOK,
		"localhost":               http.StatusOK,
		"metrics.internal:9090":   http.StatusOK,
		"rebind.attacker.example": http.StatusMisdirectedRequest,
		"rebind.attacker.example:" + portOf(tel.MetricsAddr()): http.StatusMisdirectedRequest,
	} {
		req, err := http.NewRequest(http.MethodGet, "http://"+tel.MetricsAddr()+"/metrics", nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Host = host
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("Host %s: %d, want %d", host, resp.StatusCode, want)
		}
		if want != http.StatusOK && strings.Contains(string(body), "go_goroutines") {
			t.Errorf("Host %s: metrics served with the refusal", host)
		}
	}
}

func portOf(addr string) string {
	_, port, _ := net.SplitHostPort(addr)
	return port
}
