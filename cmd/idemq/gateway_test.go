package main_test

import (
	"io"
	"net/http"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/internal/testamqp"
)

var gatewayAddrLog = regexp.MustCompile(`msg=serving .*addr=(\S+)`)

// TestGatewayAnswersAsDocumented runs `idemq gateway` and sends what the
// docs' curl session sends: the first request (202), its retry (the same 202,
// replayed), the key with a changed body (422), no key (400); after SIGTERM
// the gateway exits 0 and the queue holds exactly one message, whose
// message_id is the key.
func TestGatewayAnswersAsDocumented(t *testing.T) {
	t.Parallel()
	schema := newSchema(t)
	q := testamqp.Name(t, "cli-gateway")
	deleteTopologyAtCleanup(t, q, nil, nil, nil)
	conn := testamqp.Dial(t)
	ch := testamqp.Channel(t, conn)
	if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	p := start(t, "gateway", env(schema), "gateway", "--listen", "127.0.0.1:0", "--consumer", "orders-api",
		"--to-exchange", "", "--routing-key", q, "--doc-url", "https://api.example.com/docs/idempotency")
	var addr string
	consumertest.WaitFor(t, 30*time.Second, "the gateway's address in the log", func() bool {
		m := gatewayAddrLog.FindStringSubmatch(p.stderr.String())
		if m != nil {
			addr = m[1]
		}
		return m != nil
	})
	post := func(key, body string) (int, http.Header, string) {
		req, _ := http.NewRequest("POST", "http://"+addr+"/messages", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header, string(b)
	}
	const key = "7f3c1e8a-4b2d-4e91-a5f6-9c0d3b7e2a41"
	accepted := `{"message_id":"` + key + `","status":"accepted"}` + "\n"
	if code, h, body := post(key, `{"amount":4990}`); code != 202 || body != accepted || h.Get("Idempotent-Replayed") != "" {
		t.Fatalf("first request: %d %q", code, body)
	}
	if code, h, body := post(key, `{"amount":4990}`); code != 202 || body != accepted || h.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry: %d %q %v", code, body, h)
	}
	if code, h, body := post(key, `{"amount":9800}`); code != 422 || h.Get("Content-Type") != "application/problem+json" || !strings.Contains(body, "idempotency_key_reuse") {
		t.Fatalf("changed body: %d %q", code, body)
	}
	if code, _, body := post("", `{"amount":4990}`); code != 400 || !strings.Contains(body, `"type":"https://api.example.com/docs/idempotency#idempotency_key_required"`) {
		t.Fatalf("missing key: %d %q", code, body)
	}
	resp, err := http.Get("http://" + addr + "/healthz")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("healthz: %v, %v", resp, err)
	}
	resp.Body.Close()

	p.signal(t, syscall.SIGTERM)
	if code := p.wait(t, 60*time.Second); code != 0 {
		t.Fatalf("gateway exit code %d; output:\n%s", code, p.stderr.String())
	}
	got := drain(t, conn, q)
	if len(got) != 1 || got[0].MessageId != key || string(got[0].Body) != `{"amount":4990}` || got[0].ContentType != "application/json" {
		t.Fatalf("queue holds %d messages (%+v), want one with message_id = the key", len(got), got)
	}
	if r := mustRun(t, env(schema), "keys", "inspect", "--consumer", "orders-api", key); !strings.Contains(r.stdout, "code 202, 74 bytes, headers Content-Type") {
		t.Fatalf("keys inspect: %s", r)
	}
}
