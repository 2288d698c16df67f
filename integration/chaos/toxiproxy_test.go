package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// toxiproxy is a toxiproxy-server started for one test, and its HTTP API.
// The server is built from the module of ./toxiproxy (its own go.mod, so
// that toxiproxy stays out of idemq's), once, into a cache directory.
type toxiproxy struct {
	api    string
	client *http.Client
}

// startToxiproxy builds (once) and starts toxiproxy-server on 127.0.0.1 and
// stops it when the test ends. IDEMQ_CHAOS_TOXIPROXY names a prebuilt binary.
func startToxiproxy(t testing.TB, logDir string) *toxiproxy {
	t.Helper()
	bin := os.Getenv("IDEMQ_CHAOS_TOXIPROXY")
	if bin == "" {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		out, err := run(ctx, nil, "bash", filepath.Join("toxiproxy", "build.sh"))
		if err != nil {
			t.Fatalf("chaos: build toxiproxy-server: %v", err)
		}
		bin = strings.TrimSpace(lastLines(out, 1))
	}
	port := freePort(t)
	logFile, err := os.Create(filepath.Join(logDir, "toxiproxy.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "-host", "127.0.0.1", "-port", fmt.Sprint(port))
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		t.Fatalf("chaos: start toxiproxy-server: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = logFile.Close()
	})
	tp := &toxiproxy{api: fmt.Sprintf("http://127.0.0.1:%d", port), client: &http.Client{Timeout: 10 * time.Second}}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := waitUntil(ctx, time.Minute, func() bool { return tp.call(http.MethodGet, "/version", nil, nil) == nil }); err != nil {
		t.Fatalf("chaos: toxiproxy-server does not answer: %v", err)
	}
	return tp
}

// call sends one API request; out, when set, receives the JSON answer.
func (tp *toxiproxy) call(method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, tp.api+path, body)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := tp.client.Do(req)
	if err != nil {
		return fmt.Errorf("toxiproxy %s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("toxiproxy %s %s: %s: %s", method, path, resp.Status, bytes.TrimSpace(raw))
	}
	if out != nil {
		return json.Unmarshal(raw, out)
	}
	return nil
}

// proxy creates a proxy named name to upstream on a free local port and
// returns the address to dial instead.
func (tp *toxiproxy) proxy(t testing.TB, name, upstream string) string {
	t.Helper()
	listen := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	err := tp.call(http.MethodPost, "/proxies", map[string]any{
		"name": name, "listen": listen, "upstream": upstream, "enabled": true,
	}, nil)
	if err != nil {
		t.Fatalf("chaos: create proxy %s: %v", name, err)
	}
	return listen
}

// toxic is one toxic as toxiproxy's API describes it.
type toxic struct {
	Name       string         `json:"name"`
	Type       string         `json:"type"`
	Stream     string         `json:"stream"`
	Toxicity   float64        `json:"toxicity"`
	Attributes map[string]any `json:"attributes"`
}

func (tp *toxiproxy) addToxic(proxy string, tx toxic) error {
	return tp.call(http.MethodPost, "/proxies/"+proxy+"/toxics", tx, nil)
}

func (tp *toxiproxy) removeToxic(proxy, name string) error {
	return tp.call(http.MethodDelete, "/proxies/"+proxy+"/toxics/"+name, nil, nil)
}

// removeAllToxics removes every toxic of every proxy: the cleanup that
// leaves the network whole whatever happened.
func (tp *toxiproxy) removeAllToxics() error {
	var proxies map[string]struct {
		Toxics []toxic `json:"toxics"`
	}
	if err := tp.call(http.MethodGet, "/proxies", nil, &proxies); err != nil {
		return err
	}
	for name, p := range proxies {
		for _, tx := range p.Toxics {
			if err := tp.removeToxic(name, tx.Name); err != nil {
				return err
			}
		}
	}
	return nil
}

// freePort returns a TCP port that was free a moment ago.
func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// hostPort returns the host:port of a URL, with def as the port when it
// names none.
func hostPort(raw, def string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", fmt.Errorf("parse URL: %w", err)
	}
	host, port := u.Hostname(), u.Port()
	if host == "" {
		host = "127.0.0.1"
	}
	if port == "" {
		port = def
	}
	return net.JoinHostPort(host, port), nil
}

// withHostPort returns raw with its host:port replaced (the proxied address).
func withHostPort(raw, hp string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return raw
	}
	u.Host = hp
	return u.String()
}
