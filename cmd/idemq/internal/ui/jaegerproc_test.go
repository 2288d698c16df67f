package ui_test

import (
	"context"
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

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// testJaeger is a real Jaeger (the one deploy/jaeger builds) for the tests
// of this package: its query API (query) and its OTLP gRPC receiver (otlp).
type testJaeger struct {
	query, otlp string
}

// The package's own Jaeger, started by the first test that wants one, on
// ports of its own (so that it never meets the Jaeger of another package's
// tests, nor a developer's), and stopped by TestMain.
var ownJaeger struct {
	once sync.Once
	j    *testJaeger
	err  error
	cmd  *exec.Cmd
	// exited delivers cmd's exit (the one call of Wait is runJaeger's).
	exited <-chan error
	dir    string
}

// startJaeger returns the Jaeger of IDEMQ_TEST_JAEGER_QUERY_URL (with
// IDEMQ_TEST_OTLP_ENDPOINT, default 127.0.0.1:4317), else the package's own:
// deploy/jaeger's binary (build.sh builds it, about 10 minutes cold; make
// test does first) run with its config on free ports. No Jaeger fails tb.
func startJaeger(tb testing.TB) *testJaeger {
	tb.Helper()
	if q := os.Getenv("IDEMQ_TEST_JAEGER_QUERY_URL"); q != "" {
		j := &testJaeger{query: strings.TrimRight(q, "/"), otlp: "127.0.0.1:4317"}
		if v := os.Getenv("IDEMQ_TEST_OTLP_ENDPOINT"); v != "" {
			j.otlp = v
		}
		if !answers(j.query) {
			tb.Fatalf("jaeger: IDEMQ_TEST_JAEGER_QUERY_URL=%s does not answer on /api/services", j.query)
		}
		return j
	}
	ownJaeger.once.Do(func() { ownJaeger.j, ownJaeger.err = runJaeger() })
	if ownJaeger.err != nil {
		tb.Fatalf("jaeger: %v", ownJaeger.err)
	}
	return ownJaeger.j
}

// deployJaeger is deploy/jaeger, from this package's directory.
var deployJaeger = filepath.Join("..", "..", "..", "..", "deploy", "jaeger")

func runJaeger() (*testJaeger, error) {
	dir, err := filepath.Abs(deployJaeger)
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
	ports := map[string]string{}
	for _, p := range []string{"127.0.0.1:16686", "127.0.0.1:16685", "127.0.0.1:4317", "127.0.0.1:4318"} {
		if ports[p], err = freePort(); err != nil {
			return nil, err
		}
		if !strings.Contains(string(conf), p) {
			return nil, fmt.Errorf("%s/config.yaml no longer names %s", dir, p)
		}
		conf = []byte(strings.ReplaceAll(string(conf), p, ports[p]))
	}
	tmp, err := os.MkdirTemp("", "idemq-ui-jaeger-")
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
	j := &testJaeger{query: "http://" + ports["127.0.0.1:16686"], otlp: ports["127.0.0.1:4317"]}
	deadline := time.After(time.Minute)
	for !answers(j.query) {
		select {
		case err := <-exited:
			log, _ := os.ReadFile(logf.Name())
			ownJaeger.cmd = nil
			return nil, fmt.Errorf("%s exited (%v):\n%s", bin, err, log)
		case <-deadline:
			log, _ := os.ReadFile(logf.Name())
			return nil, fmt.Errorf("%s does not answer at %s after a minute:\n%s", bin, j.query, log)
		case <-time.After(50 * time.Millisecond): // polling its HTTP API: nothing to wait on
		}
	}
	return j, nil
}

// stopJaeger stops the package's own Jaeger, if a test started it.
func stopJaeger() {
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

// tracerProvider returns an SDK provider exporting to j over OTLP gRPC as
// service; it is shut down when tb ends.
func (j *testJaeger) tracerProvider(tb testing.TB, service string) *sdktrace.TracerProvider {
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
		if err := tp.Shutdown(ctx); err != nil && !errors.Is(err, context.Canceled) {
			tb.Logf("tracer provider shutdown: %v", err)
		}
	})
	return tp
}
