// Package telemetry configures OpenTelemetry for the idemq binary from the
// standard OTEL_* environment variables.
//
// # Traces
//
// Tracing is on only when an OTLP endpoint is configured
// (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) or
// OTEL_TRACES_EXPORTER=otlp; OTEL_TRACES_EXPORTER=none or
// OTEL_SDK_DISABLED=true turn it off whatever else is set. The protocol is
// OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL, else
// grpc; http/protobuf is the other choice. The exporters read their own
// endpoint, headers, timeout, compression and TLS variables; the SDK reads
// OTEL_TRACES_SAMPLER(_ARG), OTEL_BSP_* and the span limits. When tracing is
// off, TracerProvider returns a no-op provider and the global one is left
// alone (the OpenTelemetry default: no-op).
//
// # Metrics
//
// With Options.MetricsAddr set (or prometheus in OTEL_METRICS_EXPORTER, on
// OTEL_EXPORTER_PROMETHEUS_HOST:PORT, default localhost:9464), an HTTP
// server serves the Prometheus exposition on /metrics and a readiness check
// on /healthz: 200 "ok" while Options.Ready returns nil (or when there is no
// Ready), else 503 with the reason.
// With otlp in OTEL_METRICS_EXPORTER, metrics are also pushed over OTLP
// (OTEL_EXPORTER_OTLP_METRICS_PROTOCOL, OTEL_METRIC_EXPORT_INTERVAL, ...).
// With neither, MeterProvider returns a no-op provider.
//
// # Resource and propagation
//
// The resource is service.name = Options.ServiceName, overridden by
// OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME, plus host.name and the
// SDK's own attributes. Setup installs the W3C TraceContext and Baggage
// propagators globally, and the providers it built, unless Options.NoGlobal.
package telemetry

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/otlptranslator"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlpmetric/otlpmetricgrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlpmetric/otlpmetrichttp"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/idemq/idemq/internal/redact"
)

// DefaultServiceName is the service.name used when neither
// Options.ServiceName nor OTEL_SERVICE_NAME is set.
const DefaultServiceName = "idemq"

// Protocols accepted in OTEL_EXPORTER_OTLP_(TRACES_|METRICS_)PROTOCOL.
const (
	ProtocolGRPC         = "grpc"
	ProtocolHTTPProtobuf = "http/protobuf"
)

// SecondsBuckets are the histogram bounds, in seconds, given to every
// histogram whose unit is "s" (the SDK's default bounds suit milliseconds).
var SecondsBuckets = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}

// Options configures Setup. The zero value is valid.
type Options struct {
	// ServiceName is service.name unless OTEL_SERVICE_NAME (or service.name
	// in OTEL_RESOURCE_ATTRIBUTES) says otherwise. Default "idemq".
	ServiceName string
	// ServiceVersion, when set, is service.version.
	ServiceVersion string
	// MetricsAddr, when set, is the host:port where /metrics (Prometheus)
	// and /healthz are served. Port 0 picks a free port: see MetricsAddr.
	MetricsAddr string
	// Logger receives OpenTelemetry's internal errors (a collector that is
	// down, say) and the metrics server's failures. Default slog.Default().
	Logger *slog.Logger
	// NoGlobal leaves the otel global providers, propagator and error
	// handler alone; callers inject TracerProvider and MeterProvider.
	NoGlobal bool
	// Ready, when set, is asked by every GET /healthz: nil answers 200
	// "ok", an error 503 with its text (a consumer's Ready: not yet
	// consuming, reconnecting).
	Ready func() error
}

// Telemetry holds the providers Setup built. Its methods are safe for
// concurrent use.
type Telemetry struct {
	tp      trace.TracerProvider
	sdkTP   *sdktrace.TracerProvider
	mp      metric.MeterProvider
	sdkMP   *sdkmetric.MeterProvider
	prop    propagation.TextMapPropagator
	res     *resource.Resource
	handler http.Handler
	srv     *http.Server
	addr    string
	served  chan struct{}
	log     *slog.Logger

	once        sync.Once
	shutdownErr error
}

// Propagator is the propagator Setup installs: W3C TraceContext and Baggage.
func Propagator() propagation.TextMapPropagator {
	return propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
}

// Setup builds the tracer and meter providers from Options and the OTEL_*
// variables, starts the metrics server when asked, and installs the
// providers and the propagator globally (unless NoGlobal). Call Shutdown
// before the process exits to flush. A malformed variable is an error.
func Setup(ctx context.Context, opts Options) (*Telemetry, error) {
	log := cmp.Or(opts.Logger, slog.Default())
	env, err := readEnv()
	if err != nil {
		return nil, fmt.Errorf("telemetry: %w", err)
	}
	t := &Telemetry{
		tp:   tracenoop.NewTracerProvider(),
		mp:   metricnoop.NewMeterProvider(),
		prop: Propagator(),
		log:  log,
	}
	metricsAddr := opts.MetricsAddr
	if metricsAddr == "" && env.prometheus {
		metricsAddr = env.prometheusAddr
	}
	if env.traces || env.otlpMetrics || metricsAddr != "" {
		if t.res, err = newResource(ctx, opts); err != nil {
			return nil, fmt.Errorf("telemetry: resource: %w", err)
		}
	}
	if env.traces {
		exp, err := newTraceExporter(ctx, env.tracesProtocol)
		if err != nil {
			return nil, fmt.Errorf("telemetry: trace exporter: %w", err)
		}
		// The SDK reads OTEL_TRACES_SAMPLER(_ARG) and OTEL_BSP_* itself.
		t.sdkTP = sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(t.res))
		t.tp = t.sdkTP
	}
	if env.otlpMetrics || metricsAddr != "" {
		if err := t.setupMetrics(ctx, env, metricsAddr, opts.Ready); err != nil {
			_ = t.Shutdown(context.WithoutCancel(ctx))
			return nil, fmt.Errorf("telemetry: %w", err)
		}
	}
	if !opts.NoGlobal {
		otel.SetTextMapPropagator(t.prop)
		otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
			log.Warn("opentelemetry", "err", redact.Error(err))
		}))
		if t.sdkTP != nil {
			otel.SetTracerProvider(t.sdkTP)
		}
		if t.sdkMP != nil {
			otel.SetMeterProvider(t.sdkMP)
		}
	}
	log.Debug("telemetry configured", "tracing", t.TracingEnabled(), "traces_protocol", env.tracesProtocol,
		"metrics_addr", t.addr, "otlp_metrics", env.otlpMetrics)
	return t, nil
}

func (t *Telemetry) setupMetrics(ctx context.Context, env envConfig, addr string, ready func() error) error {
	opts := []sdkmetric.Option{
		sdkmetric.WithResource(t.res),
		sdkmetric.WithView(sdkmetric.NewView(
			sdkmetric.Instrument{Kind: sdkmetric.InstrumentKindHistogram, Unit: "s"},
			sdkmetric.Stream{Aggregation: sdkmetric.AggregationExplicitBucketHistogram{Boundaries: SecondsBuckets}},
		)),
	}
	if addr != "" {
		reg := prometheus.NewRegistry()
		reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
		exp, err := otelprom.New(otelprom.WithRegisterer(reg),
			otelprom.WithTranslationStrategy(otlptranslator.UnderscoreEscapingWithSuffixes))
		if err != nil {
			return fmt.Errorf("prometheus exporter: %w", err)
		}
		opts = append(opts, sdkmetric.WithReader(exp))
		t.handler = promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorLog: promLogger{t.log}})
	}
	if env.otlpMetrics {
		exp, err := newMetricExporter(ctx, env.metricsProtocol)
		if err != nil {
			return fmt.Errorf("metric exporter: %w", err)
		}
		// The reader reads OTEL_METRIC_EXPORT_INTERVAL and _TIMEOUT itself.
		opts = append(opts, sdkmetric.WithReader(sdkmetric.NewPeriodicReader(exp)))
	}
	t.sdkMP = sdkmetric.NewMeterProvider(opts...)
	t.mp = t.sdkMP
	if addr == "" {
		return nil
	}
	ln, err := (&net.ListenConfig{}).Listen(context.Background(), "tcp", addr)
	if err != nil {
		return fmt.Errorf("metrics server: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", t.handler)
	mux.Handle("GET /healthz", HealthHandler(ready))
	t.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	t.addr = ln.Addr().String()
	t.served = make(chan struct{})
	go func() {
		defer close(t.served)
		if err := t.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			t.log.Error("metrics server stopped", "addr", t.addr, "err", err)
		}
	}()
	return nil
}

// HealthHandler answers 200 "ok" while ready returns nil (or ready is nil),
// else 503 Service Unavailable with "not ready: " and the reason.
func HealthHandler(ready func() error) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("Cache-Control", "no-store")
		if ready != nil {
			if err := ready(); err != nil {
				w.WriteHeader(http.StatusServiceUnavailable)
				_, _ = fmt.Fprintf(w, "not ready: %s\n", redact.Error(err))
				return
			}
		}
		_, _ = w.Write([]byte("ok\n"))
	})
}

// TracerProvider returns the SDK provider when tracing is on, else a no-op one.
func (t *Telemetry) TracerProvider() trace.TracerProvider { return t.tp }

// MeterProvider returns the SDK provider when metrics are exported, else a no-op one.
func (t *Telemetry) MeterProvider() metric.MeterProvider { return t.mp }

// TextMapPropagator returns the W3C TraceContext + Baggage propagator.
func (t *Telemetry) TextMapPropagator() propagation.TextMapPropagator { return t.prop }

// TracingEnabled reports whether spans are recorded and exported.
func (t *Telemetry) TracingEnabled() bool { return t.sdkTP != nil }

// MetricsAddr is the address the metrics server listens on ("" when none),
// with the port resolved when Options.MetricsAddr asked for port 0.
func (t *Telemetry) MetricsAddr() string { return t.addr }

// MetricsHandler is the Prometheus /metrics handler, to mount on another
// server; nil when no Prometheus exposition was asked for.
func (t *Telemetry) MetricsHandler() http.Handler { return t.handler }

// Resource returns the resource the providers describe (nil when both are no-ops).
func (t *Telemetry) Resource() *resource.Resource { return t.res }

// ForceFlush exports the spans and metrics recorded so far.
func (t *Telemetry) ForceFlush(ctx context.Context) error {
	var errs []error
	if t.sdkTP != nil {
		errs = append(errs, t.sdkTP.ForceFlush(ctx))
	}
	if t.sdkMP != nil {
		errs = append(errs, t.sdkMP.ForceFlush(ctx))
	}
	return errors.Join(errs...)
}

// Shutdown stops the metrics server, flushes the spans and metrics still
// buffered and shuts the exporters down. Later calls return the first
// call's result.
func (t *Telemetry) Shutdown(ctx context.Context) error {
	t.once.Do(func() {
		var errs []error
		if t.srv != nil {
			if err := t.srv.Shutdown(ctx); err != nil {
				errs = append(errs, fmt.Errorf("metrics server: %w", err))
				_ = t.srv.Close()
			}
			<-t.served
		}
		if t.sdkTP != nil {
			if err := t.sdkTP.Shutdown(ctx); err != nil {
				errs = append(errs, fmt.Errorf("tracer provider: %w", err))
			}
		}
		if t.sdkMP != nil {
			if err := t.sdkMP.Shutdown(ctx); err != nil {
				errs = append(errs, fmt.Errorf("meter provider: %w", err))
			}
		}
		if err := errors.Join(errs...); err != nil {
			t.shutdownErr = fmt.Errorf("telemetry: shutdown: %w", err)
		}
	})
	return t.shutdownErr
}

func newResource(ctx context.Context, opts Options) (*resource.Resource, error) {
	attrs := []attribute.KeyValue{attribute.String("service.name", cmp.Or(opts.ServiceName, DefaultServiceName))}
	if opts.ServiceVersion != "" {
		attrs = append(attrs, attribute.String("service.version", opts.ServiceVersion))
	}
	// Later options win: the environment overrides the programmatic name.
	res, err := resource.New(ctx,
		resource.WithAttributes(attrs...),
		resource.WithTelemetrySDK(),
		resource.WithHost(),
		resource.WithFromEnv(),
	)
	if errors.Is(err, resource.ErrPartialResource) {
		// A detector failed (no hostname, say); keep what was detected.
		slog.Default().Debug("telemetry: partial resource", "err", err)
		err = nil
	}
	return res, err
}

func newTraceExporter(ctx context.Context, protocol string) (sdktrace.SpanExporter, error) {
	// Both read OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, _HEADERS, _TIMEOUT,
	// _COMPRESSION, _CERTIFICATE and _INSECURE themselves.
	if protocol == ProtocolHTTPProtobuf {
		return otlptracehttp.New(ctx)
	}
	return otlptracegrpc.New(ctx)
}

func newMetricExporter(ctx context.Context, protocol string) (sdkmetric.Exporter, error) {
	if protocol == ProtocolHTTPProtobuf {
		return otlpmetrichttp.New(ctx)
	}
	return otlpmetricgrpc.New(ctx)
}

// envConfig is what Setup decides from the OTEL_* variables.
type envConfig struct {
	traces          bool
	tracesProtocol  string
	otlpMetrics     bool
	metricsProtocol string
	prometheus      bool
	prometheusAddr  string
}

func readEnv() (envConfig, error) {
	var c envConfig
	if strings.EqualFold(strings.TrimSpace(os.Getenv("OTEL_SDK_DISABLED")), "true") {
		return c, nil
	}
	tracesExp, err := exporterList("OTEL_TRACES_EXPORTER", "otlp", "none")
	if err != nil {
		return c, err
	}
	endpoint := os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
	c.traces = !slices.Contains(tracesExp, "none") && (slices.Contains(tracesExp, "otlp") || endpoint)
	if c.traces {
		if c.tracesProtocol, err = protocol("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"); err != nil {
			return c, err
		}
	}
	metricsExp, err := exporterList("OTEL_METRICS_EXPORTER", "otlp", "prometheus", "none")
	if err != nil {
		return c, err
	}
	if !slices.Contains(metricsExp, "none") {
		c.otlpMetrics = slices.Contains(metricsExp, "otlp")
		c.prometheus = slices.Contains(metricsExp, "prometheus")
	}
	if c.otlpMetrics {
		if c.metricsProtocol, err = protocol("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"); err != nil {
			return c, err
		}
	}
	if c.prometheus {
		c.prometheusAddr = net.JoinHostPort(
			cmp.Or(os.Getenv("OTEL_EXPORTER_PROMETHEUS_HOST"), "localhost"),
			cmp.Or(os.Getenv("OTEL_EXPORTER_PROMETHEUS_PORT"), "9464"))
	}
	return c, nil
}

// exporterList reads a comma-separated OTEL_*_EXPORTER variable.
func exporterList(name string, allowed ...string) ([]string, error) {
	var out []string
	for v := range strings.SplitSeq(os.Getenv(name), ",") {
		v = strings.ToLower(strings.TrimSpace(v))
		if v == "" {
			continue
		}
		if !slices.Contains(allowed, v) {
			return nil, fmt.Errorf("%s=%q: idemq supports %s", name, v, strings.Join(allowed, ", "))
		}
		out = append(out, v)
	}
	return out, nil
}

// protocol reads the signal's protocol variable, else
// OTEL_EXPORTER_OTLP_PROTOCOL, else grpc.
func protocol(signalVar string) (string, error) {
	name := signalVar
	v := strings.TrimSpace(os.Getenv(signalVar))
	if v == "" {
		name, v = "OTEL_EXPORTER_OTLP_PROTOCOL", strings.TrimSpace(os.Getenv("OTEL_EXPORTER_OTLP_PROTOCOL"))
	}
	switch strings.ToLower(v) {
	case "", ProtocolGRPC:
		return ProtocolGRPC, nil
	case ProtocolHTTPProtobuf:
		return ProtocolHTTPProtobuf, nil
	}
	return "", fmt.Errorf("%s=%q: idemq supports %s and %s", name, v, ProtocolGRPC, ProtocolHTTPProtobuf)
}

// promLogger routes promhttp's errors to slog.
type promLogger struct{ log *slog.Logger }

func (l promLogger) Println(v ...any) { l.log.Warn("metrics: " + fmt.Sprint(v...)) }
