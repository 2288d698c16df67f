package interop

import "go.opentelemetry.io/otel/propagation"

// HeaderMTActivityID is where MassTransit puts the id of its sending
// Activity (DiagnosticHeaders.ActivityId); with .NET's default W3C id
// format the id is a traceparent ("00-<trace>-<span>-<flags>").
const HeaderMTActivityID = "MT-Activity-Id"

// traceAliases are, for each preset, the headers that carry its W3C trace
// context when the message has no traceparent and tracestate headers:
// MassTransit's Activity id; a binary CloudEvent's distributed tracing
// extension attributes.
var traceAliases = map[string]map[string][]string{
	MassTransit: {"traceparent": {HeaderMTActivityID}},
	CloudEvents: {
		"traceparent": {"cloudEvents_traceparent", "cloudEvents:traceparent", "ce-traceparent"},
		"tracestate":  {"cloudEvents_tracestate", "cloudEvents:tracestate", "ce-tracestate"},
	},
}

// TraceCarrier returns how a consumer of preset wraps a delivery's
// headers before it extracts their trace context: traceparent and
// tracestate are read from the framework's own headers when absent.
func TraceCarrier(preset string) func(headers propagation.TextMapCarrier) propagation.TextMapCarrier {
	aliases := traceAliases[preset]
	if aliases == nil {
		return func(headers propagation.TextMapCarrier) propagation.TextMapCarrier { return headers }
	}
	return func(headers propagation.TextMapCarrier) propagation.TextMapCarrier {
		return aliasCarrier{headers, aliases}
	}
}

type aliasCarrier struct {
	propagation.TextMapCarrier
	aliases map[string][]string
}

func (a aliasCarrier) Get(key string) string {
	if v := a.TextMapCarrier.Get(key); v != "" {
		return v
	}
	for _, alias := range a.aliases[key] {
		if v := a.TextMapCarrier.Get(alias); v != "" {
			return v
		}
	}
	return ""
}
