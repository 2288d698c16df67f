package keys_test

import (
	"testing"
	"time"

	"github.com/idemq/idemq/cmd/idemq/internal/keys"
	"github.com/idemq/idemq/dedup"
)

func TestReportTraceLink(t *testing.T) {
	now := time.Now()
	rec := &dedup.Record{Scope: dedup.Scope{Consumer: "c"}, State: dedup.StateCompleted, TraceID: "4bf92f3577b34da6a3ce929d0e0e4736", CreatedAt: now}
	r := keys.NewReport(rec, "h", false, "http://jaeger:16686/")
	if r.TraceURL != "http://jaeger:16686/trace/4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Errorf("trace url %q", r.TraceURL)
	}
	rec.TraceID = "00000000000000000000000000000000" // no tracer installed
	if r = keys.NewReport(rec, "h", false, "http://jaeger:16686"); r.TraceID != "" || r.TraceURL != "" {
		t.Errorf("zero trace id: %+v", r)
	}
}
