// Package jaegertest gives the binary's tests a real Jaeger
// (internal/testjaeger) and a tracer provider exporting to it.
package jaegertest

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/idemq/idemq/internal/testjaeger"
)

// Jaeger is a running Jaeger (testjaeger.Jaeger: Query, OTLP).
type Jaeger struct{ testjaeger.Jaeger }

// Start returns a running Jaeger (testjaeger.Start). TestMain calls Stop
// after the tests.
func Start(tb testing.TB) *Jaeger {
	tb.Helper()
	return &Jaeger{*testjaeger.Start(tb)}
}

// Stop stops the test binary's own Jaeger, if a test started it.
func Stop() { testjaeger.Stop() }

// TracerProvider returns an SDK provider exporting to j over OTLP gRPC
// with a batch span processor, as service; it is shut down when tb ends.
// ForceFlush it before reading: Jaeger stores the spans before it answers.
func (j *Jaeger) TracerProvider(tb testing.TB, service string) *sdktrace.TracerProvider {
	tb.Helper()
	exp, err := otlptracegrpc.New(context.Background(), otlptracegrpc.WithEndpoint(j.OTLP), otlptracegrpc.WithInsecure())
	if err != nil {
		tb.Fatalf("otlp exporter: %v", err)
	}
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exp),
		sdktrace.WithSampler(sdktrace.AlwaysSample()),
		sdktrace.WithResource(resource.NewSchemaless(attribute.String("service.name", service))),
	)
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := tp.Shutdown(ctx); err != nil && !errors.Is(err, context.Canceled) {
			tb.Logf("tracer provider shutdown: %v", err)
		}
	})
	return tp
}
