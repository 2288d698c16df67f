package main_test

import (
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testamqp"
)

// `idemq ui` refuses to listen beyond loopback without a token, and serves
// there with one, asking every request for it.
func TestUIListensOnLoopbackUnlessAToken(t *testing.T) {
	t.Parallel()
	schema := newSchema(t)
	mustRun(t, env(schema), "migrate")
	for _, addr := range []string{"0.0.0.0:0", ":0", "[::]:0"} {
		r := idemq(t, env(schema), "ui", "--listen", addr)
		if r.code != 2 || !strings.Contains(r.stderr, "not a loopback address: give --auth-token-file") {
			t.Fatalf("ui --listen %s: %s", addr, r)
		}
	}
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte("short\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if r := idemq(t, env(schema), "ui", "--listen", "0.0.0.0:0", "--auth-token-file", tokenFile); r.code != 2 || !strings.Contains(r.stderr, "at least 16 characters") {
		t.Fatalf("short token: %s", r)
	}
	const token = "0123456789abcdef-token"
	if err := os.WriteFile(tokenFile, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	p := start(t, "ui", env(schema), "ui", "--listen", "0.0.0.0:0", "--auth-token-file", tokenFile)
	addr := waitServing(t, p)
	port := addr[strings.LastIndex(addr, ":"):]
	get := func(auth string) int {
		req, _ := http.NewRequest(http.MethodGet, "http://127.0.0.1"+port+"/", nil)
		if auth != "" {
			req.Header.Set("Authorization", "Bearer "+auth)
		}
		c := &http.Client{Timeout: 10 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		return resp.StatusCode
	}
	if code := get(""); code != http.StatusSeeOther {
		t.Fatalf("without the token: %d", code)
	}
	if code := get(token); code != http.StatusOK {
		t.Fatalf("with the token: %d", code)
	}
	if r := idemq(t, env(schema), "ui", "--warn-retrying", "0"); r.code != 2 || !strings.Contains(r.stderr, "must be positive") {
		t.Fatalf("ui --warn-retrying 0: %s", r)
	}
	p.signal(t, syscall.SIGTERM)
	if code := p.wait(t, 15*time.Second); code != 0 {
		t.Fatalf("ui exit %d:\n%s", code, p.stderr.String())
	}
}

var serving = regexp.MustCompile(`idemq ui: serving http://(\S+)/`)

// waitServing waits for the UI's "serving" line and returns its address.
func waitServing(t *testing.T, p *proc) string {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if m := serving.FindStringSubmatch(p.stderr.String()); m != nil {
			return m[1]
		}
		select {
		case <-p.done:
			t.Fatalf("ui exited %d:\n%s", p.code, p.stderr.String())
		case <-time.After(20 * time.Millisecond): // poll interval
		}
		if time.Now().After(deadline) {
			t.Fatalf("ui not serving:\n%s", p.stderr.String())
		}
	}
}

// `idemq ui --partitions N` shows each --queue as a partitioned queue: its
// partitions in the overview, each partition's dead letters on a page.
func TestUIShowsPartitions(t *testing.T) {
	t.Parallel()
	schema := newSchema(t)
	queue := testamqp.Name(t, "uiord")
	queues, exchanges := consumer.NewTopology(consumer.TopologyConfig{Queue: queue, Partitions: 2}).Names()
	testamqp.DeleteQueuesAtCleanup(t, queues, exchanges)
	mustRun(t, env(schema), "topology", "apply", "--queue", queue, "--partitions", "2")
	if r := idemq(t, env(schema), "ui", "--queue", queue, "--partitions", "-1"); r.code != 2 || !strings.Contains(r.stderr, "--partitions -1") {
		t.Fatalf("ui --partitions -1: %s", r)
	}
	p := start(t, "ui", env(schema), "ui", "--listen", "127.0.0.1:0", "--queue", queue+"=ledger", "--partitions", "2")
	base := "http://" + waitServing(t, p)
	get := func(path string) (int, string) {
		resp, err := (&http.Client{Timeout: 10 * time.Second}).Get(base + path)
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
	code, body := get("/")
	for _, want := range []string{`id="partition-` + queue + `.p0"`, `id="partition-` + queue + `.p1"`, "No ordering key is blocked", "Nothing needs you."} {
		if code != http.StatusOK || !strings.Contains(body, want) {
			t.Fatalf("overview (%d) lacks %q:\n%s", code, want, body)
		}
	}
	if code, body := get("/api/health"); code != http.StatusOK || !strings.Contains(body, `"status": "ok"`) {
		t.Fatalf("/api/health: %d\n%s", code, body)
	}
	if code, body := get("/dlq?queue=" + queue + ".p1"); code != http.StatusOK {
		t.Fatalf("/dlq?queue=%s.p1: %d\n%s", queue, code, body)
	}
	p.signal(t, syscall.SIGTERM)
	if code := p.wait(t, 15*time.Second); code != 0 {
		t.Fatalf("ui exit %d:\n%s", code, p.stderr.String())
	}
}
