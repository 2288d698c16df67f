package telemetry_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/cmd/idemq/internal/telemetry"
	"github.com/idemq/idemq/dedup/deduptest"
	"github.com/idemq/idemq/dedup/idemhttp"
	"github.com/idemq/idemq/internal/testdb"
)

// The HTTP middleware's counter under the name and labels
// docs/observability.md gives it, read from /metrics as Prometheus would.
func TestHTTPMetricNames(t *testing.T) {
	t.Parallel()
	tel := setup(t, telemetry.Options{ServiceName: "idemq-it-http-metrics-" + testdb.RandomHex(4), MetricsAddr: "127.0.0.1:0"})
	store := deduptest.Store(t, testdb.Pool(t, 4), nil)
	mw, err := idemhttp.New(store, &idemhttp.Config{Consumer: "metered-api", MeterProvider: tel.MeterProvider(), TracerProvider: tel.TracerProvider()})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw.Require(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	})))
	t.Cleanup(srv.Close)
	for _, key := range []string{"k-1", "k-1", ""} {
		req, err := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader("{}"))
		if err != nil {
			t.Fatal(err)
		}
		if key != "" {
			req.Header.Set(idemhttp.DefaultHeader, key)
		}
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	// The counter is added once the answer is written: wait for the last.
	want := map[string]float64{"processed": 1, "duplicate": 1, "invalid_key": 1}
	deadline := time.After(10 * time.Second)
	for {
		fams := scrapeMetrics(t, "http://"+tel.MetricsAddr()+"/metrics")
		all := true
		for outcome, n := range want {
			if v, _ := sampleValue(fams, "idemq_http_requests_total", map[string]string{"idemq_consumer": "metered-api", "outcome": outcome}); v != n {
				all = false
			}
		}
		if all {
			return
		}
		select {
		case <-deadline:
			t.Fatalf("idemq_http_requests_total: want %v by outcome; /metrics has %v", want, fams["idemq_http_requests_total"])
		case <-time.After(50 * time.Millisecond):
		}
	}
}
