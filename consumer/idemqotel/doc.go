// Package idemqotel sets up OpenTelemetry for a program that runs idemq's
// consumers and relays, in one call: traces and metrics exported as the
// standard OTEL_* variables say, a Prometheus /metrics handler and a
// /healthz readiness handler to mount on the program's own HTTP server (or
// served by Setup on an address of its own).
//
// It is a module of its own (github.com/idemq/idemq/consumer/idemqotel), so
// that the OpenTelemetry SDK, its exporters and the Prometheus client stay
// out of the graph of a program that imports only the library.
//
// # Setup
//
//	tel, err := idemqotel.Setup(ctx, idemqotel.Options{ServiceName: "payments"})
//	if err != nil { ... }
//	defer tel.Shutdown(context.Background())
//	cfg.TracerProvider, cfg.MeterProvider = tel.TracerProvider(), tel.MeterProvider()
//	go http.ListenAndServe(":9090", tel.Handler()) // GET /metrics, GET /healthz
//
// The consumer and the relay need no propagator: theirs defaults to W3C
// TraceContext + Baggage. Setup also installs that propagator and the
// providers it built as the otel globals (unless Options.NoGlobal), for the
// program's own instrumentation.
//
// # Variables
//
// The exporters are chosen by go.opentelemetry.io/contrib/exporters/autoexport
// and read their own variables (endpoint, headers, timeout, compression,
// TLS); the SDK reads the sampler (OTEL_TRACES_SAMPLER, _ARG), the batch
// span processor (OTEL_BSP_*), the span limits and the metric export
// interval. Setup adds three decisions of its own:
//
//   - Traces are exported only when an exporter is asked for: an OTLP
//     endpoint (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)
//     or OTEL_TRACES_EXPORTER (otlp, console; none turns tracing off even
//     with an endpoint). Without one, TracerProvider is the no-op provider:
//     a worker does not log export errors for a collector nobody set up.
//   - Metrics are pushed only when OTEL_METRICS_EXPORTER names a push
//     exporter (otlp, console). OTEL_METRICS_EXPORTER=prometheus serves the
//     exposition on OTEL_EXPORTER_PROMETHEUS_HOST:OTEL_EXPORTER_PROMETHEUS_PORT
//     (default localhost:9464) when Options.Addr is empty.
//   - OTEL_SDK_DISABLED=true turns everything off (no-op providers).
//
// The OTLP protocol is OTEL_EXPORTER_OTLP_(TRACES_|METRICS_)PROTOCOL, else
// Options.OTLPProtocol, else http/protobuf (the specification's default).
// The resource is service.name = Options.ServiceName (overridden by
// OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES), host.name and the SDK's
// attributes. A malformed or unknown value is an error naming the variable.
//
// # Metrics
//
// The Prometheus exposition (Handler's /metrics, MetricsHandler) is on
// unless Options.NoPrometheus. It holds the idemq metrics, target_info, and
// the Go runtime's go_* and the process's process_* collectors. Every
// histogram whose unit is "s" gets SecondsBuckets. With neither the
// exposition nor a push exporter, MeterProvider is the no-op provider.
//
// # Readiness
//
// GET /healthz answers 200 "ok" while Options.Ready returns nil (or when it
// is nil) and 503 with the error's text otherwise: give it the readiness of
// the consumers the program runs.
package idemqotel
