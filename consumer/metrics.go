package consumer

import (
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
)

// metrics are the consumer's OpenTelemetry instruments.
type metrics struct {
	deliveries  metric.Int64Counter
	retries     metric.Int64Counter
	deadLetters metric.Int64Counter
	reconnects  metric.Int64Counter
	inProgress  metric.Int64UpDownCounter
	handlerTime metric.Float64Histogram
	reserveTime metric.Float64Histogram
}

func newMetrics(mp metric.MeterProvider) (*metrics, error) {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	m := mp.Meter(instrumentation)
	var out metrics
	var err error
	if out.deliveries, err = m.Int64Counter("idemq.consumer.deliveries",
		metric.WithDescription("Deliveries by outcome."), metric.WithUnit("{delivery}")); err != nil {
		return nil, err
	}
	if out.retries, err = m.Int64Counter("idemq.consumer.retries",
		metric.WithDescription("Copies published to a retry tier."), metric.WithUnit("{message}")); err != nil {
		return nil, err
	}
	if out.deadLetters, err = m.Int64Counter("idemq.consumer.dead_letters",
		metric.WithDescription("Copies published to the DLQ, by reason."), metric.WithUnit("{message}")); err != nil {
		return nil, err
	}
	if out.reconnects, err = m.Int64Counter("idemq.consumer.reconnects",
		metric.WithDescription("Broker reconnections."), metric.WithUnit("{reconnect}")); err != nil {
		return nil, err
	}
	if out.inProgress, err = m.Int64UpDownCounter("idemq.consumer.keys_in_progress",
		metric.WithDescription("Keys held by running handlers."), metric.WithUnit("{key}")); err != nil {
		return nil, err
	}
	if out.handlerTime, err = m.Float64Histogram("idemq.consumer.handler.duration",
		metric.WithDescription("Handler run time, commit included."), metric.WithUnit("s")); err != nil {
		return nil, err
	}
	if out.reserveTime, err = m.Float64Histogram("idemq.consumer.reserve.duration",
		metric.WithDescription("Key reservation time."), metric.WithUnit("s")); err != nil {
		return nil, err
	}
	return &out, nil
}
