// Package telemetry configures OpenTelemetry for the idemq binary: the
// public github.com/idemq/idemq/consumer/idemqotel with the binary's
// defaults. service.name is idemq; OTLP speaks gRPC unless
// OTEL_EXPORTER_OTLP_(TRACES_|METRICS_)PROTOCOL says http/protobuf (the
// deploy files send to port 4317); metrics exist only when --metrics-addr
// (Options.MetricsAddr) or OTEL_METRICS_EXPORTER asks for them, so a
// command run without either records none. Everything else, the variables
// read included, is idemqotel's (docs/observability.md).
package telemetry

import (
	"cmp"
	"context"
	"log/slog"

	"github.com/idemq/idemq/consumer/idemqotel"
)

// DefaultServiceName is the service.name used when neither
// Options.ServiceName nor OTEL_SERVICE_NAME is set.
const DefaultServiceName = "idemq"

// SecondsBuckets are the bounds of every histogram whose unit is "s".
var SecondsBuckets = idemqotel.SecondsBuckets

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
	// AllowHosts are the names, beyond MetricsAddr's host and localhost,
	// that the metrics server answers to (--allow-host); others get 421.
	AllowHosts []string
	// Ready is what /healthz reports (nil: always ready).
	Ready func() error
	// Logger receives OpenTelemetry's internal errors and the metrics
	// server's failures. Default slog.Default().
	Logger *slog.Logger
	// NoGlobal leaves the otel global providers, propagator and error
	// handler alone; callers inject TracerProvider and MeterProvider.
	NoGlobal bool
}

// Telemetry holds the providers Setup built.
type Telemetry = idemqotel.Telemetry

// Setup builds the providers from opts and the OTEL_* variables, starts
// the metrics server when asked and installs the globals unless NoGlobal.
func Setup(ctx context.Context, opts Options) (*Telemetry, error) {
	return idemqotel.Setup(ctx, idemqotel.Options{
		ServiceName:    cmp.Or(opts.ServiceName, DefaultServiceName),
		ServiceVersion: opts.ServiceVersion,
		Addr:           opts.MetricsAddr,
		AllowHosts:     opts.AllowHosts,
		Ready:          opts.Ready,
		NoPrometheus:   opts.MetricsAddr == "",
		OTLPProtocol:   idemqotel.ProtocolGRPC,
		Logger:         opts.Logger,
		NoGlobal:       opts.NoGlobal,
	})
}
