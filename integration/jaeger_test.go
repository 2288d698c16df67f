package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/internal/testjaeger"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// jaeger is a Jaeger reachable by OTLP gRPC (otlp) and its query API (query).
type jaeger struct {
	query, otlp string
}

// startJaeger returns a running Jaeger: the test binary's own, or the one
// IDEMQ_TEST_JAEGER_QUERY_URL names (testjaeger.Start; TestMain stops it).
func startJaeger(tb testing.TB) *jaeger {
	tb.Helper()
	j := testjaeger.Start(tb)
	return &jaeger{query: j.Query, otlp: j.OTLP}
}

// tracerProvider returns an SDK provider exporting to j over OTLP gRPC with
// a batch span processor, as service; it is shut down when tb ends.
func (j *jaeger) tracerProvider(tb testing.TB, service string) *sdktrace.TracerProvider {
	tb.Helper()
	exp, err := otlptracegrpc.New(context.Background(), otlptracegrpc.WithEndpoint(j.otlp), otlptracegrpc.WithInsecure())
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
		_ = tp.Shutdown(ctx)
	})
	return tp
}

// flush exports every span ended so far; Jaeger stores them before it answers.
func flush(tb testing.TB, tp *sdktrace.TracerProvider) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := tp.ForceFlush(ctx); err != nil {
		tb.Fatalf("flush spans to jaeger: %v", err)
	}
}

// The v1 JSON of Jaeger's query API (deploy/jaeger/README.md).
type (
	jTrace struct {
		TraceID   string              `json:"traceID"`
		Spans     []jSpan             `json:"spans"`
		Processes map[string]jProcess `json:"processes"`
	}
	jProcess struct {
		ServiceName string `json:"serviceName"`
	}
	jSpan struct {
		TraceID       string `json:"traceID"`
		SpanID        string `json:"spanID"`
		OperationName string `json:"operationName"`
		References    []jRef `json:"references"`
		Tags          []jTag `json:"tags"`
		Logs          []jLog `json:"logs"`
		ProcessID     string `json:"processID"`
	}
	jRef struct {
		RefType string `json:"refType"`
		TraceID string `json:"traceID"`
		SpanID  string `json:"spanID"`
	}
	jTag struct {
		Key   string `json:"key"`
		Type  string `json:"type"`
		Value any    `json:"value"`
	}
	jLog struct {
		Fields []jTag `json:"fields"`
	}
	jAnswer struct {
		Data   []jTrace `json:"data"`
		Errors []struct {
			Code int    `json:"code"`
			Msg  string `json:"msg"`
		} `json:"errors"`
	}
)

// tag returns the value of the span's tag key as text, and whether it is there.
func (s jSpan) tag(key string) (string, bool) {
	return tagValue(s.Tags, key)
}

func tagValue(tags []jTag, key string) (string, bool) {
	for _, t := range tags {
		if t.Key == key {
			return fmt.Sprint(t.Value), true
		}
	}
	return "", false
}

// parent returns the span's CHILD_OF reference ("" for a root span).
func (s jSpan) parent() string {
	for _, r := range s.References {
		if r.RefType == "CHILD_OF" {
			return r.SpanID
		}
	}
	return ""
}

// byName returns the trace's spans named op.
func (tr jTrace) byName(op string) []jSpan {
	var out []jSpan
	for _, s := range tr.Spans {
		if s.OperationName == op {
			out = append(out, s)
		}
	}
	return out
}

func (tr jTrace) names() []string {
	var out []string
	for _, s := range tr.Spans {
		out = append(out, s.OperationName)
	}
	return out
}

// sameTraceID compares trace IDs in hex, whatever their case and padding.
func sameTraceID(a, b string) bool {
	norm := func(s string) string {
		s = strings.ToLower(s)
		return strings.Repeat("0", max(0, 32-len(s))) + s
	}
	return norm(a) == norm(b)
}

func (j *jaeger) get(ctx context.Context, path string, q url.Values) (*jAnswer, int, error) {
	u := j.query + path
	if q != nil {
		u += "?" + q.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusNotFound {
		return nil, resp.StatusCode, nil
	}
	var a jAnswer
	if err := json.NewDecoder(resp.Body).Decode(&a); err != nil {
		return nil, resp.StatusCode, fmt.Errorf("GET %s: %s: %w", u, resp.Status, err)
	}
	if resp.StatusCode != http.StatusOK || len(a.Errors) > 0 {
		return nil, resp.StatusCode, fmt.Errorf("GET %s: %s: %v", u, resp.Status, a.Errors)
	}
	return &a, resp.StatusCode, nil
}

// waitTrace polls /api/traces/<id> until ok accepts the trace, or fails tb
// after timeout with the last trace seen.
func (j *jaeger) waitTrace(tb testing.TB, traceID string, timeout time.Duration, ok func(jTrace) bool) jTrace {
	tb.Helper()
	var last jTrace
	var lastErr error
	testenv.Poll(tb, timeout, func(ctx context.Context) bool {
		a, _, err := j.get(ctx, "/api/traces/"+traceID, nil)
		if lastErr = err; err != nil || a == nil || len(a.Data) == 0 {
			return false
		}
		last = a.Data[0]
		return ok(last)
	}, func() string { return fmt.Sprintf("trace %s: last error %v, spans %q", traceID, lastErr, last.names()) })
	return last
}

// waitFind polls /api/traces?service=&operation=&tags= until ok accepts
// the traces found. An empty operation or nil tags do not filter.
func (j *jaeger) waitFind(tb testing.TB, service, operation string, tags map[string]string, timeout time.Duration, ok func([]jTrace) bool) []jTrace {
	tb.Helper()
	enc, err := json.Marshal(tags)
	if err != nil {
		tb.Fatal(err)
	}
	q := url.Values{"service": {service}, "limit": {"50"}}
	if operation != "" {
		q.Set("operation", operation)
	}
	if len(tags) > 0 {
		q.Set("tags", string(enc))
	}
	var last []jTrace
	var lastErr error
	testenv.Poll(tb, timeout, func(ctx context.Context) bool {
		a, _, err := j.get(ctx, "/api/traces", q)
		if lastErr = err; err != nil || a == nil {
			return false
		}
		last = a.Data
		return ok(last)
	}, func() string {
		return fmt.Sprintf("search service=%s tags=%s: last error %v, %d traces", service, enc, lastErr, len(last))
	})
	return last
}
