package consumer

import (
	"sync"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// durationBuckets are the histogram bounds, in seconds, advised for the
// latency instruments (the SDK's default bounds suit milliseconds).
var durationBuckets = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}

// metrics are the consumer's OpenTelemetry instruments. Every measurement
// carries the queue and the consumer name (idemq.queue, idemq.consumer).
type metrics struct {
	deliveries  metric.Int64Counter
	retries     metric.Int64Counter
	deadLetters metric.Int64Counter
	reconnects  metric.Int64Counter
	// repliesFailed counts replies to reply_to the broker did not take.
	repliesFailed metric.Int64Counter
	inProgress    metric.Int64UpDownCounter
	handlerTime   metric.Float64Histogram
	reserveTime   metric.Float64Histogram

	base  attribute.Set
	attrs []attribute.KeyValue
	// labelled caches the options of with(attribute.String(k, v)) by k
	// and v: outcomes and reasons are a small vocabulary, and each
	// measurement would otherwise build its attribute set anew.
	labelled sync.Map // label -> metric.MeasurementOption
}

// label is one attribute of a cached measurement option.
type label struct{ key, value string }

func newMetrics(mp metric.MeterProvider, queue, name string) (*metrics, error) {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	m := mp.Meter(instrumentation)
	base := []attribute.KeyValue{attribute.String("idemq.queue", queue), attribute.String(attrConsumer, name)}
	out := metrics{base: attribute.NewSet(base...), attrs: base}
	var err error
	if out.deliveries, err = m.Int64Counter("idemq.consumer.deliveries",
		metric.WithDescription("Deliveries by outcome."), metric.WithUnit("{delivery}")); err != nil {
		return nil, err
	}
	if out.retries, err = m.Int64Counter("idemq.consumer.retries",
		metric.WithDescription("Failed deliveries sent to a retry tier for another attempt."), metric.WithUnit("{message}")); err != nil {
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
	if out.repliesFailed, err = m.Int64Counter("idemq.consumer.replies_failed",
		metric.WithDescription("Replies to reply_to that the broker returned, refused or did not confirm."), metric.WithUnit("{message}")); err != nil {
		return nil, err
	}
	if out.inProgress, err = m.Int64UpDownCounter("idemq.consumer.keys_in_progress",
		metric.WithDescription("Keys held by running handlers."), metric.WithUnit("{key}")); err != nil {
		return nil, err
	}
	if out.handlerTime, err = m.Float64Histogram("idemq.consumer.handler.duration",
		metric.WithDescription("Handler run time, commit included."), metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(durationBuckets...)); err != nil {
		return nil, err
	}
	if out.reserveTime, err = m.Float64Histogram("idemq.consumer.reserve.duration",
		metric.WithDescription("Key reservation time."), metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(durationBuckets...)); err != nil {
		return nil, err
	}
	return &out, nil
}

// withLabel returns the base attributes plus the string attribute key=value
// as a measurement option, built once per key and value.
func (m *metrics) withLabel(key, value string) metric.MeasurementOption {
	l := label{key, value}
	if o, ok := m.labelled.Load(l); ok {
		return o.(metric.MeasurementOption)
	}
	set := attribute.NewSet(append(m.attrs[:len(m.attrs):len(m.attrs)], attribute.String(key, value))...)
	o, _ := m.labelled.LoadOrStore(l, metric.WithAttributeSet(set))
	return o.(metric.MeasurementOption)
}

// with returns the base attributes plus kv as a measurement option.
func (m *metrics) with(kv ...attribute.KeyValue) metric.MeasurementOption {
	if len(kv) == 0 {
		return metric.WithAttributeSet(m.base)
	}
	return metric.WithAttributes(append(m.attrs[:len(m.attrs):len(m.attrs)], kv...)...)
}
