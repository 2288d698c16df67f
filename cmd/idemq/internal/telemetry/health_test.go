package telemetry_test

import (
	"errors"
	"io"
	"net/http"
	"sync/atomic"
	"testing"

	"github.com/idemq/idemq/cmd/idemq/internal/telemetry"
)

// TestHealthzFollowsReady: /healthz answers 503 with the reason while Ready
// returns an error, and 200 "ok" while it returns nil.
func TestHealthzFollowsReady(t *testing.T) {
	cleanEnv(t, nil)
	var why atomic.Pointer[error]
	set := func(err error) { why.Store(&err) }
	set(errors.New("consumer not ready: not yet connected"))
	tel := setup(t, telemetry.Options{MetricsAddr: "127.0.0.1:0", Ready: func() error { return *why.Load() }})
	status := func() (int, string) {
		t.Helper()
		resp, err := http.Get("http://" + tel.MetricsAddr() + "/healthz")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, string(b)
	}
	if code, body := status(); code != http.StatusServiceUnavailable || body != "not ready: consumer not ready: not yet connected\n" {
		t.Fatalf("/healthz before consuming: %d %q; want 503 with the reason", code, body)
	}
	set(nil)
	if code, body := status(); code != http.StatusOK || body != "ok\n" {
		t.Fatalf("/healthz while consuming: %d %q; want 200 ok", code, body)
	}
	set(errors.New("consumer not ready: reconnecting: connection closed"))
	if code, _ := status(); code != http.StatusServiceUnavailable {
		t.Fatalf("/healthz while reconnecting: %d; want 503", code)
	}
}

// TestMetricsServerChecksHost: the metrics server answers to its address,
// localhost and the allowed names, and refuses a rebound name with 421.
func TestMetricsServerChecksHost(t *testing.T) {
	cleanEnv(t, nil)
	tel := setup(t, telemetry.Options{MetricsAddr: "127.0.0.1:0", AllowHosts: []string{"worker.internal"}})
	for host, want := range map[string]int{
		tel.MetricsAddr():              http.StatusOK,
		"localhost":                    http.StatusOK,
		"worker.internal":              http.StatusOK,
		"rebind.attacker.example:9090": http.StatusMisdirectedRequest,
	} {
		req, err := http.NewRequest(http.MethodGet, "http://"+tel.MetricsAddr()+"/healthz", nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Host = host
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("Host %s: /healthz %d, want %d", host, resp.StatusCode, want)
		}
	}
}
