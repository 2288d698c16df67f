package demo

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/idemq/idemq/cmd/idemq/internal/jaeger"
)

// The local Jaeger the demo looks for when no OTLP endpoint is configured
// (what `make jaeger` starts: deploy/jaeger/config.yaml).
const (
	localOTLP   = "127.0.0.1:4317"
	localJaeger = "http://127.0.0.1:16686"
	// jaegerHint is the one command that gets a local Jaeger.
	jaegerHint = "run `make jaeger` (or set OTEL_EXPORTER_OTLP_ENDPOINT and " + JaegerURLEnv + "), then `make demo` again"
	// traceWait bounds the wait for the workers' spans to reach Jaeger.
	traceWait = 30 * time.Second
)

// tracingTarget decides where the workers' spans go. With
// OTEL_EXPORTER_OTLP_ENDPOINT (or the traces one) set it changes nothing.
// Otherwise, when a Jaeger answers locally (OTLP/gRPC port and query API),
// it points the workers at it (they inherit the environment) and returns
// its query URL for the trace check. Otherwise it returns jaegerURL as given.
func tracingTarget(ctx context.Context, jaegerURL string) string {
	if os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != "" {
		return jaegerURL
	}
	if os.Getenv("OTEL_TRACES_EXPORTER") == "none" || os.Getenv("OTEL_SDK_DISABLED") == "true" {
		return jaegerURL
	}
	query := jaegerURL
	if query == "" {
		query = localJaeger
	}
	dialer := net.Dialer{Timeout: time.Second}
	conn, err := dialer.DialContext(ctx, "tcp", localOTLP)
	if err != nil {
		return jaegerURL
	}
	conn.Close()
	if !jaegerAnswers(ctx, query) {
		return jaegerURL
	}
	os.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+localOTLP) //nolint:errcheck // only fails on an invalid name
	os.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")              //nolint:errcheck
	return query
}

// jaegerAnswers reports whether Jaeger's query API answers at base.
func jaegerAnswers(ctx context.Context, base string) bool {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/api/services", nil)
	if err != nil {
		return false
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// jaegerServesUI reports whether the Jaeger at base serves its own UI (an
// error reading it counts as yes: nothing is known against its links).
func jaegerServesUI(ctx context.Context, base string) bool {
	c, err := jaeger.New(base, &jaeger.Config{Timeout: 2 * time.Second})
	if err != nil {
		return true
	}
	defer c.Close()
	ui, err := c.HasUI(ctx)
	return ui || err != nil
}

// jaegerTrace is the part of Jaeger's /api/traces/{id} answer the check reads.
type jaegerTrace struct {
	Data []struct {
		Spans []struct {
			SpanID string `json:"spanID"`
			Tags   []struct {
				Key   string
				Value any
			} `json:"tags"`
			References []struct {
				RefType string `json:"refType"`
				TraceID string `json:"traceID"`
				SpanID  string `json:"spanID"`
			} `json:"references"`
		} `json:"spans"`
	} `json:"data"`
}

// tracePair is a suppressed duplicate's trace and the trace of the
// processing it duplicated.
type tracePair struct{ Duplicate, Original string }

// traceCandidates is how many duplicates the report tries in Jaeger.
const traceCandidates = 20

// findDuplicateInJaeger waits until Jaeger holds one of the candidates: the
// trace of a suppressed duplicate whose span (idemq.outcome = duplicate)
// links to the original processing's trace, and that trace too. It returns
// the first found, else what is missing after traceWait.
func findDuplicateInJaeger(ctx context.Context, base string, candidates []tracePair) (tracePair, error) {
	if !jaegerAnswers(ctx, base) {
		return tracePair{}, fmt.Errorf("no Jaeger answers at %s", base)
	}
	ctx, cancel := context.WithTimeout(ctx, traceWait)
	defer cancel()
	for {
		var why error
		for _, c := range candidates {
			if why = duplicateLinked(ctx, base, c.Duplicate, c.Original); why == nil {
				return c, nil
			}
		}
		select {
		case <-ctx.Done():
			return tracePair{}, fmt.Errorf("none of %d duplicates in Jaeger after %s: %w", len(candidates), traceWait, why)
		case <-time.After(500 * time.Millisecond): // polling an HTTP API: nothing to wait on
		}
	}
}

func duplicateLinked(ctx context.Context, base, dupTrace, origTrace string) error {
	dup, err := fetchTrace(ctx, base, dupTrace)
	if err != nil {
		return err
	}
	linked, origSpan := false, ""
	for _, d := range dup.Data {
		for _, s := range d.Spans {
			isDup := false
			for _, t := range s.Tags {
				if t.Key == "idemq.outcome" && fmt.Sprint(t.Value) == "duplicate" {
					isDup = true
				}
			}
			for _, r := range s.References {
				if isDup && r.RefType == "FOLLOWS_FROM" && sameTrace(r.TraceID, origTrace) {
					linked, origSpan = true, r.SpanID
				}
			}
		}
	}
	if !linked {
		return fmt.Errorf("trace %s has no duplicate span linking to trace %s", dupTrace, origTrace)
	}
	orig, err := fetchTrace(ctx, base, origTrace)
	if err != nil {
		return err
	}
	if len(orig.Data) == 0 || len(orig.Data[0].Spans) == 0 {
		return fmt.Errorf("the original trace %s has no spans", origTrace)
	}
	// The original processing's own span, not only its publisher's: a
	// worker killed before it exported its spans leaves the trace without it.
	for _, s := range orig.Data[0].Spans {
		if strings.TrimLeft(s.SpanID, "0") == strings.TrimLeft(origSpan, "0") {
			return nil
		}
	}
	return fmt.Errorf("the original trace %s lacks the span %s the duplicate links to", origTrace, origSpan)
}

func fetchTrace(ctx context.Context, base, id string) (*jaegerTrace, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/api/traces/"+id, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("jaeger: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("jaeger: trace %s: %s", id, resp.Status)
	}
	var tr jaegerTrace
	if err := json.NewDecoder(resp.Body).Decode(&tr); err != nil {
		return nil, fmt.Errorf("jaeger: trace %s: %w", id, err)
	}
	return &tr, nil
}

// sameTrace compares trace ids as Jaeger and OTel write them (Jaeger may
// drop leading zeros).
func sameTrace(a, b string) bool {
	return strings.TrimLeft(strings.ToLower(a), "0") == strings.TrimLeft(strings.ToLower(b), "0")
}
