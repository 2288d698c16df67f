package demo

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// jaegerAPI answers /api/services and /api/traces/{id} with the given
// traces (Jaeger's JSON), 404 for the others.
func jaegerAPI(t *testing.T, traces map[string]string) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.URL.Path == "/api/services":
			w.Write([]byte(`{"data":["payments"]}`)) //nolint:errcheck
		case strings.HasPrefix(r.URL.Path, "/api/traces/"):
			body, ok := traces[strings.TrimPrefix(r.URL.Path, "/api/traces/")]
			if !ok {
				http.NotFound(w, r)
				return
			}
			w.Write([]byte(body)) //nolint:errcheck
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

const (
	dupTrace  = "0af7651916cd43dd8448eb211c80319c"
	origTrace = "0bf7651916cd43dd8448eb211c80319c"
	// dupSpans is a duplicate's process span linking (FOLLOWS_FROM) to the
	// original, as Jaeger shows an OTel span link.
	dupSpans = `{"data":[{"spans":[{"spanID":"b7ad6b7169203331","tags":[{"key":"idemq.outcome","type":"string","value":"duplicate"}],
"references":[{"refType":"FOLLOWS_FROM","traceID":"` + origTrace + `","spanID":"00f067aa0ba902b7"}]}]}]}`
	origSpans = `{"data":[{"spans":[{"spanID":"00f067aa0ba902b7","tags":[{"key":"idemq.outcome","type":"string","value":"processed"}]}]}]}`
)

func TestDuplicateLinkedInJaeger(t *testing.T) {
	base := jaegerAPI(t, map[string]string{dupTrace: dupSpans, origTrace: origSpans})
	lost := tracePair{Duplicate: "1af7651916cd43dd8448eb211c80319c", Original: origTrace} // a killed worker's
	got, err := findDuplicateInJaeger(context.Background(), base, []tracePair{lost, {dupTrace, origTrace}})
	if err != nil || got.Duplicate != dupTrace {
		t.Fatalf("found %+v, %v; want the duplicate Jaeger holds", got, err)
	}
}

func TestDuplicateWithoutTheLinkIsReported(t *testing.T) {
	unlinked := strings.Replace(dupSpans, "FOLLOWS_FROM", "CHILD_OF", 1)
	base := jaegerAPI(t, map[string]string{dupTrace: unlinked, origTrace: origSpans})
	err := duplicateLinked(context.Background(), base, dupTrace, origTrace)
	if err == nil || !strings.Contains(err.Error(), "no duplicate span linking") {
		t.Fatalf("check of an unlinked duplicate: %v", err)
	}
	base = jaegerAPI(t, map[string]string{dupTrace: dupSpans})
	if err := duplicateLinked(context.Background(), base, dupTrace, origTrace); err == nil || !strings.Contains(err.Error(), "404") {
		t.Fatalf("check without the original trace: %v", err)
	}
	// The original trace holds only its publisher's span: the worker that
	// processed it was killed before it exported its own.
	publisherOnly := `{"data":[{"spans":[{"spanID":"1111111111111111","tags":[]}]}]}`
	base = jaegerAPI(t, map[string]string{dupTrace: dupSpans, origTrace: publisherOnly})
	if err := duplicateLinked(context.Background(), base, dupTrace, origTrace); err == nil || !strings.Contains(err.Error(), "lacks the span 00f067aa0ba902b7") {
		t.Fatalf("check of an original without its processing span: %v", err)
	}
}

func TestNoJaegerFailsAtOnce(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	base := srv.URL
	srv.Close()
	_, err := findDuplicateInJaeger(context.Background(), base, []tracePair{{dupTrace, origTrace}})
	if err == nil || !strings.Contains(err.Error(), "no Jaeger answers") {
		t.Fatalf("check against nothing: %v", err)
	}
}
