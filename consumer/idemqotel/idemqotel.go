package idemqotel

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/otlptranslator"
	"go.opentelemetry.io/contrib/exporters/autoexport"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlpmetric/otlpmetricgrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/idemq/idemq/internal/hostguard"
	"github.com/idemq/idemq/internal/redact"
)

// Protocols of Options.OTLPProtocol and OTEL_EXPORTER_OTLP_*PROTOCOL.
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
	// in OTEL_RESOURCE_ATTRIBUTES) says otherwise. Default: the SDK's,
	// unknown_service:<executable>.
	ServiceName string
	// ServiceVersion, when set, is service.version.
	ServiceVersion string
	// Addr, when set, is the host:port where Setup serves Handler on a
	// server of its own, until Shutdown. Port 0 picks a free port (see
	// MetricsAddr).
	Addr string
	// AllowHosts are the names, beyond the address Addr listens on and
	// localhost, that the server on Addr answers to (exactly, or
	// "*.example.com"); a request whose Host is another name gets 421, so
	// that a web page whose name is rebound to this host cannot read it.
	// An IP literal the server listens on is always allowed.
	AllowHosts []string
	// Ready is the readiness /healthz reports: 200 while it returns nil,
	// 503 with the error's text otherwise. nil: always ready.
	Ready func() error
	// NoPrometheus leaves the Prometheus exposition out (no /metrics),
	// unless OTEL_METRICS_EXPORTER=prometheus asks for it.
	NoPrometheus bool
	// OTLPProtocol is the OTLP protocol when no OTEL_EXPORTER_OTLP_*PROTOCOL
	// variable names one: ProtocolHTTPProtobuf (the default) or ProtocolGRPC.
	OTLPProtocol string
	// Logger receives OpenTelemetry's internal errors (a collector that is
	// down, say) and the metrics server's failures. Default slog.Default().
	Logger *slog.Logger
	// NoGlobal leaves the otel global providers, propagator and error
	// handler alone; the caller passes TracerProvider and MeterProvider on.
	NoGlobal bool
}

// Telemetry holds what Setup built. Its methods are safe for concurrent use.
type Telemetry struct {
	tp      trace.TracerProvider
	sdkTP   *sdktrace.TracerProvider
	mp      metric.MeterProvider
	sdkMP   *sdkmetric.MeterProvider
	res     *resource.Resource
	metrics http.Handler
	handler http.Handler
	srv     *http.Server
	addr    string
	served  chan struct{}
	log     *slog.Logger

	once        sync.Once
	shutdownErr error
}

// Propagator returns the W3C TraceContext + Baggage propagator, the one
// Setup installs globally.
func Propagator() propagation.TextMapPropagator {
	return propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
}

// Setup builds the tracer and meter providers from opts and the OTEL_*
// variables (see the package documentation), serves Handler on opts.Addr
// when it is set, and installs the providers, the W3C propagator and an
// error handler logging to opts.Logger as the otel globals, unless
// opts.NoGlobal. Call Shutdown before the program exits, to flush.
func Setup(ctx context.Context, opts Options) (*Telemetry, error) {
	t, err := setup(ctx, opts)
	if err != nil {
		return nil, fmt.Errorf("telemetry: %w", err)
	}
	return t, nil
}

func setup(ctx context.Context, opts Options) (*Telemetry, error) {
	if p := opts.OTLPProtocol; p != "" && p != ProtocolGRPC && p != ProtocolHTTPProtobuf {
		return nil, fmt.Errorf("OTLP protocol option %q: want %s or %s", p, ProtocolGRPC, ProtocolHTTPProtobuf)
	}
	t := &Telemetry{
		tp:  tracenoop.NewTracerProvider(),
		mp:  metricnoop.NewMeterProvider(),
		log: cmp.Or(opts.Logger, slog.Default()),
	}
	disabled := strings.EqualFold(strings.TrimSpace(os.Getenv("OTEL_SDK_DISABLED")), "true")
	var spans sdktrace.SpanExporter
	var push sdkmetric.Reader
	var promFromEnv, promExported bool
	var err error
	metricsAddr := opts.Addr
	if !disabled {
		if spans, err = spanExporter(ctx, opts); err != nil {
			return nil, err
		}
		if push, promFromEnv, err = metricReader(ctx, opts); err != nil {
			if spans != nil {
				_ = spans.Shutdown(ctx)
			}
			return nil, err
		}
		promExported = !opts.NoPrometheus || promFromEnv
		if metricsAddr == "" && promFromEnv {
			metricsAddr = net.JoinHostPort(
				cmp.Or(os.Getenv("OTEL_EXPORTER_PROMETHEUS_HOST"), "localhost"),
				cmp.Or(os.Getenv("OTEL_EXPORTER_PROMETHEUS_PORT"), "9464"))
		}
	}
	if spans != nil || push != nil || promExported {
		if t.res, err = newResource(ctx, opts); err != nil {
			return nil, errors.Join(fmt.Errorf("resource: %w", err), shutdownAll(ctx, spans, push))
		}
	}
	if spans != nil {
		// The SDK reads OTEL_TRACES_SAMPLER(_ARG), OTEL_BSP_* and the limits.
		t.sdkTP = sdktrace.NewTracerProvider(sdktrace.WithBatcher(spans), sdktrace.WithResource(t.res))
		t.tp = t.sdkTP
	}
	if push != nil || promExported {
		if err := t.newMeterProvider(push, promExported); err != nil {
			return nil, errors.Join(err, t.Shutdown(ctx), shutdownAll(ctx, nil, push))
		}
	}
	t.handler = t.newHandler(opts.Ready)
	if metricsAddr != "" {
		if err := t.serve(metricsAddr, opts.AllowHosts); err != nil {
			return nil, errors.Join(err, t.Shutdown(context.WithoutCancel(ctx)))
		}
	}
	if !opts.NoGlobal {
		otel.SetTextMapPropagator(Propagator())
		otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
			t.log.Warn("opentelemetry", "err", redact.Error(err))
		}))
		if t.sdkTP != nil {
			otel.SetTracerProvider(t.sdkTP)
		}
		if t.sdkMP != nil {
			otel.SetMeterProvider(t.sdkMP)
		}
	}
	t.log.Debug("telemetry configured", "tracing", t.TracingEnabled(), "metrics_addr", t.addr,
		"prometheus", t.metrics != nil, "metrics_push", push != nil)
	return t, nil
}

// spanExporter returns the exporter the variables ask for, or nil when
// tracing is off.
func spanExporter(ctx context.Context, opts Options) (sdktrace.SpanExporter, error) {
	name := os.Getenv("OTEL_TRACES_EXPORTER")
	if name == "" && os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" && os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "" {
		return nil, nil // no exporter asked for
	}
	vars := []string{"OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"}
	var exp sdktrace.SpanExporter
	var err error
	if (name == "" || name == "otlp") && grpcByDefault(opts, vars[1]) {
		exp, err = otlptracegrpc.New(ctx)
	} else {
		// Unset, autoexport's default is otlp (an endpoint is set).
		exp, err = autoexport.NewSpanExporter(ctx)
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", describe(vars), err)
	}
	if autoexport.IsNoneSpanExporter(exp) {
		return nil, nil
	}
	return exp, nil
}

// metricReader returns the push reader the variables ask for (nil when
// none), and whether they ask for the Prometheus exposition.
func metricReader(ctx context.Context, opts Options) (sdkmetric.Reader, bool, error) {
	name := os.Getenv("OTEL_METRICS_EXPORTER")
	switch name {
	case "", "none":
		// Unset means no push (the specification says otlp): a worker
		// should not log export errors for a collector nobody set up.
		return nil, false, nil
	case "prometheus":
		return nil, true, nil
	}
	vars := []string{"OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"}
	if name == "otlp" && grpcByDefault(opts, vars[1]) {
		exp, err := otlpmetricgrpc.New(ctx)
		if err != nil {
			return nil, false, fmt.Errorf("%s: %w", describe(vars), err)
		}
		// The reader reads OTEL_METRIC_EXPORT_INTERVAL and _TIMEOUT itself.
		return sdkmetric.NewPeriodicReader(exp), false, nil
	}
	r, err := autoexport.NewMetricReader(ctx)
	if err != nil {
		return nil, false, fmt.Errorf("%s: %w", describe(vars), err)
	}
	return r, false, nil
}

// grpcByDefault reports whether Options.OTLPProtocol picks gRPC because no
// variable names the signal's protocol.
func grpcByDefault(opts Options, signalVar string) bool {
	return opts.OTLPProtocol == ProtocolGRPC && os.Getenv(signalVar) == "" && os.Getenv("OTEL_EXPORTER_OTLP_PROTOCOL") == ""
}

// describe names the variables among vars that are set, with their values.
func describe(vars []string) string {
	var set []string
	for _, v := range vars {
		if val, ok := os.LookupEnv(v); ok && val != "" {
			set = append(set, fmt.Sprintf("%s=%q", v, val))
		}
	}
	if len(set) == 0 {
		return vars[0] + " unset"
	}
	return strings.Join(set, " ")
}

func shutdownAll(ctx context.Context, spans sdktrace.SpanExporter, push sdkmetric.Reader) error {
	var errs []error
	if spans != nil {
		errs = append(errs, spans.Shutdown(ctx))
	}
	if push != nil {
		errs = append(errs, push.Shutdown(ctx))
	}
	return errors.Join(errs...)
}

func (t *Telemetry) newMeterProvider(push sdkmetric.Reader, prom bool) error {
	opts := []sdkmetric.Option{
		sdkmetric.WithResource(t.res),
		sdkmetric.WithView(sdkmetric.NewView(
			sdkmetric.Instrument{Kind: sdkmetric.InstrumentKindHistogram, Unit: "s"},
			sdkmetric.Stream{Aggregation: sdkmetric.AggregationExplicitBucketHistogram{Boundaries: SecondsBuckets}},
		)),
	}
	if push != nil {
		opts = append(opts, sdkmetric.WithReader(push))
	}
	if prom {
		reg := prometheus.NewRegistry()
		reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
		exp, err := otelprom.New(otelprom.WithRegisterer(reg),
			otelprom.WithTranslationStrategy(otlptranslator.UnderscoreEscapingWithSuffixes))
		if err != nil {
			return fmt.Errorf("prometheus exporter: %w", err)
		}
		opts = append(opts, sdkmetric.WithReader(exp))
		t.metrics = promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorLog: promLogger{t.log}})
	}
	t.sdkMP = sdkmetric.NewMeterProvider(opts...)
	t.mp = t.sdkMP
	return nil
}

func (t *Telemetry) newHandler(ready func() error) http.Handler {
	mux := http.NewServeMux()
	if t.metrics != nil {
		mux.Handle("GET /metrics", t.metrics)
	}
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if ready != nil {
			if err := ready(); err != nil {
				w.WriteHeader(http.StatusServiceUnavailable)
				_, _ = fmt.Fprintf(w, "not ready: %s\n", redact.Error(err))
				return
			}
		}
		_, _ = w.Write([]byte("ok\n"))
	})
	return mux
}

func (t *Telemetry) serve(addr string, allowHosts []string) error {
	guard, err := hostguard.New(addr, allowHosts)
	if err != nil {
		return fmt.Errorf("metrics server: %w", err)
	}
	ln, err := (&net.ListenConfig{}).Listen(context.Background(), "tcp", addr)
	if err != nil {
		return fmt.Errorf("metrics server: %w", err)
	}
	t.srv = &http.Server{Handler: guard.Handler(t.handler), ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout: 30 * time.Second, WriteTimeout: time.Minute, IdleTimeout: time.Minute}
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

// TracerProvider returns the SDK provider when traces are exported, else a
// no-op one.
func (t *Telemetry) TracerProvider() trace.TracerProvider { return t.tp }

// MeterProvider returns the SDK provider when metrics are exposed or
// pushed, else a no-op one.
func (t *Telemetry) MeterProvider() metric.MeterProvider { return t.mp }

// TextMapPropagator returns the W3C TraceContext + Baggage propagator.
func (t *Telemetry) TextMapPropagator() propagation.TextMapPropagator { return Propagator() }

// TracingEnabled reports whether spans are recorded and exported.
func (t *Telemetry) TracingEnabled() bool { return t.sdkTP != nil }

// Handler serves GET /metrics (the Prometheus exposition, when on) and GET
// /healthz (Options.Ready), to mount on the program's own server. It does
// not check the request's Host: the program's server does (the server on
// Options.Addr refuses names other than Options.AllowHosts).
func (t *Telemetry) Handler() http.Handler { return t.handler }

// MetricsHandler is the Prometheus /metrics handler alone; nil when the
// exposition is off.
func (t *Telemetry) MetricsHandler() http.Handler { return t.metrics }

// MetricsAddr is the address Setup's own server listens on ("" when none),
// with the port resolved when Options.Addr asked for port 0.
func (t *Telemetry) MetricsAddr() string { return t.addr }

// Resource returns the resource the providers describe (nil when both are
// no-ops).
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

// Shutdown stops Setup's server, flushes the spans and metrics still
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
	// The SDK's default name, unless opts or the environment name it.
	name := cmp.Or(opts.ServiceName, "unknown_service:"+filepath.Base(os.Args[0]))
	attrs := []attribute.KeyValue{attribute.String("service.name", name)}
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

// promLogger routes promhttp's errors to slog.
type promLogger struct{ log *slog.Logger }

func (l promLogger) Println(v ...any) { l.log.Warn("metrics: " + fmt.Sprint(v...)) }
