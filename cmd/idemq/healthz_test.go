package main_test

import (
	"io"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

// TestForwardHealthz: a forwarder's /healthz answers 200 once it consumes,
// 503 (with the reason) while it reconnects, here because the broker
// refuses its user after its connection was closed, and 200 again once it
// consumes again.
func TestForwardHealthz(t *testing.T) {
	t.Parallel()
	schema := newSchema(t)
	q := testamqp.Name(t, "cli-healthz")
	deleteTopologyAtCleanup(t, q, []string{"200ms", "400ms"}, nil, nil)
	topo := []string{"--queue", q, "--max-attempts", "3", "--retry-initial", "200ms", "--retry-multiplier", "2"}
	mustRun(t, env(schema), append([]string{"topology", "apply"}, topo...)...)
	user, userURL := testamqp.AddUser(t, "healthz")
	name := "healthz-" + testdb.RandomHex(4)
	args := append([]string{"forward", "--consumer", name, "--to-exchange", "", "--to-routing-key", q + ".elsewhere",
		"--metrics-addr", "127.0.0.1:0"}, topo...)
	p := start(t, "forwarder", env(schema, "IDEMQ_AMQP_URL="+userURL), args...)

	var addr string
	consumertest.WaitFor(t, 30*time.Second, "the metrics address in the log", func() bool {
		m := metricsAddrLog.FindStringSubmatch(p.stderr.String())
		if m != nil {
			addr = m[1]
		}
		return m != nil
	})
	status := func() (int, string) {
		resp, err := http.Get("http://" + addr + "/healthz")
		if err != nil {
			t.Fatalf("GET /healthz: %v", err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, string(b)
	}
	waitStatus := func(want int, what string) string {
		t.Helper()
		var body string
		consumertest.WaitFor(t, 60*time.Second, what, func() bool {
			var code int
			code, body = status()
			return code == want
		})
		return body
	}
	waitStatus(http.StatusOK, "/healthz 200 while consuming")

	testamqp.SetPermissions(t, user, false)
	if n := testamqp.CloseConnections(t, "idemq-forward-"+name); n == 0 {
		t.Fatal("no connection of the forwarder to close")
	}
	if body := waitStatus(http.StatusServiceUnavailable, "/healthz 503 while reconnecting"); !strings.Contains(body, "reconnecting") {
		t.Errorf("/healthz while reconnecting: %q; want the reason", body)
	}
	testamqp.SetPermissions(t, user, true)
	waitStatus(http.StatusOK, "/healthz 200 once consuming again")

	p.signal(t, syscall.SIGTERM)
	if code := p.wait(t, 60*time.Second); code != 0 {
		t.Fatalf("forwarder exit code %d; output:\n%s", code, p.stderr.String())
	}
}
