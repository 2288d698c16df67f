// Package testjaeger gives tests of every module a real Jaeger: the one
// deploy/jaeger builds (its query API without the UI's assets, OTLP in,
// memory storage), run by the test binary on ports of its own, or the one
// the environment names. It starts a process and nothing else, so that the
// library's module needs no exporter for it.
package testjaeger

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// Jaeger is a running Jaeger: the base URL of its query API (Query, e.g.
// http://127.0.0.1:16686) and the host:port of its OTLP gRPC receiver.
type Jaeger struct {
	Query, OTLP string
}

// The test binary's own Jaeger, started by the first test that wants one,
// on ports of its own (so that it never meets the Jaeger of another test
// binary, nor a developer's), and stopped by Stop.
var ownJaeger struct {
	once sync.Once
	j    *Jaeger
	err  error
	cmd  *exec.Cmd
	// exited delivers cmd's exit (the one call of Wait is runJaeger's).
	exited <-chan error
	dir    string
}

// Start returns the Jaeger of IDEMQ_TEST_JAEGER_QUERY_URL (with
// IDEMQ_TEST_OTLP_ENDPOINT, default 127.0.0.1:4317), else the test binary's
// own: deploy/jaeger's binary (build.sh builds it, about 10 minutes cold;
// make test does first) run with its config on free ports. No Jaeger fails
// tb. TestMain calls Stop after the tests.
func Start(tb testing.TB) *Jaeger {
	tb.Helper()
	if q := os.Getenv("IDEMQ_TEST_JAEGER_QUERY_URL"); q != "" {
		j := &Jaeger{Query: strings.TrimRight(q, "/"), OTLP: "127.0.0.1:4317"}
		if v := os.Getenv("IDEMQ_TEST_OTLP_ENDPOINT"); v != "" {
			j.OTLP = v
		}
		if !answers(j.Query) {
			tb.Fatalf("jaeger: IDEMQ_TEST_JAEGER_QUERY_URL=%s does not answer on /api/services", j.Query)
		}
		return j
	}
	ownJaeger.once.Do(func() { ownJaeger.j, ownJaeger.err = runJaeger() })
	if ownJaeger.err != nil {
		tb.Fatalf("jaeger: %v", ownJaeger.err)
	}
	return ownJaeger.j
}

// deployJaeger finds deploy/jaeger in the directories above the test's.
func deployJaeger() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		d := filepath.Join(dir, "deploy", "jaeger")
		if _, err := os.Stat(filepath.Join(d, "build.sh")); err == nil {
			return d, nil
		}
		up := filepath.Dir(dir)
		if up == dir {
			return "", errors.New("no deploy/jaeger/build.sh above the test's directory")
		}
		dir = up
	}
}

func runJaeger() (*Jaeger, error) {
	dir, err := deployJaeger()
	if err != nil {
		return nil, err
	}
	out, err := exec.Command(filepath.Join(dir, "build.sh"), "--cached").Output()
	if err != nil {
		return nil, fmt.Errorf("the local Jaeger is not built: run %s/build.sh once (about 10 minutes cold; make test does it first)", dir)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	bin := lines[len(lines)-1]
	conf, err := os.ReadFile(filepath.Join(dir, "config.yaml"))
	if err != nil {
		return nil, err
	}
	// The ports are replaced in one pass: replacing one after another would
	// rewrite a free port that begins with a later default (127.0.0.1:43175
	// holds 127.0.0.1:4317).
	ports := map[string]string{}
	var oldNew []string
	for _, p := range []string{"127.0.0.1:16686", "127.0.0.1:16685", "127.0.0.1:4317", "127.0.0.1:4318"} {
		if ports[p], err = freePort(); err != nil {
			return nil, err
		}
		if !strings.Contains(string(conf), p) {
			return nil, fmt.Errorf("%s/config.yaml no longer names %s", dir, p)
		}
		oldNew = append(oldNew, p, ports[p])
	}
	conf = []byte(strings.NewReplacer(oldNew...).Replace(string(conf)))
	tmp, err := os.MkdirTemp("", "idemq-test-jaeger-")
	if err != nil {
		return nil, err
	}
	ownJaeger.dir = tmp
	if err := os.WriteFile(filepath.Join(tmp, "config.yaml"), conf, 0o600); err != nil {
		return nil, err
	}
	logf, err := os.Create(filepath.Join(tmp, "jaeger.log"))
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	cmd := exec.Command(bin, "--config", filepath.Join(tmp, "config.yaml"))
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	ownJaeger.cmd = cmd
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	ownJaeger.exited = exited
	j := &Jaeger{Query: "http://" + ports["127.0.0.1:16686"], OTLP: ports["127.0.0.1:4317"]}
	deadline := time.After(time.Minute)
	for !answers(j.Query) {
		select {
		case err := <-exited:
			log, _ := os.ReadFile(logf.Name())
			ownJaeger.cmd = nil
			return nil, fmt.Errorf("%s exited (%v):\n%s", bin, err, log)
		case <-deadline:
			log, _ := os.ReadFile(logf.Name())
			return nil, fmt.Errorf("%s does not answer at %s after a minute:\n%s", bin, j.Query, log)
		case <-time.After(50 * time.Millisecond): // polling its HTTP API: nothing to wait on
		}
	}
	return j, nil
}

// Stop stops the test binary's own Jaeger, if a test started it.
func Stop() {
	if ownJaeger.cmd != nil && ownJaeger.cmd.Process != nil {
		_ = ownJaeger.cmd.Process.Kill()
		<-ownJaeger.exited
	}
	if ownJaeger.dir != "" {
		_ = os.RemoveAll(ownJaeger.dir)
	}
}

func freePort() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

func answers(query string) bool {
	client := http.Client{Timeout: 2 * time.Second}
	resp, err := client.Get(query + "/api/services")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}
