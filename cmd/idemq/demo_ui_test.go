package main_test

import (
	"context"
	"io"
	"net/http"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemq/idemq/cmd/idemq/internal/jaeger/jaegertest"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/internal/testenv"
)

// `idemq demo --ui`, its spans exported to a real Jaeger that has no UI
// (deploy/jaeger's): the link it prints opens, in idemq ui, the trace of a
// suppressed duplicate, which links to the original processing's trace,
// whose spans that page shows; the Duplicates page lists the duplicates.
// What a person does after `make demo ARGS=--ui`, with no other tool.
func TestDemoUIShowsADuplicate(t *testing.T) {
	t.Parallel()
	j := jaegertest.Start(t)
	suffix := testdb.RandomHex(4)
	schema, queue := "idemq_demo_ui_"+suffix, "idemq.demo.ui."+suffix
	pool := testdb.Pool(t, 2)
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+schema+" CASCADE")
	})
	deleteTopologyAtCleanup(t, queue, []string{"200ms", "400ms", "800ms"}, nil, nil)
	environ := env("idemq", "IDEMQ_JAEGER_URL="+j.Query,
		"OTEL_EXPORTER_OTLP_ENDPOINT=http://"+j.OTLP, "OTEL_EXPORTER_OTLP_PROTOCOL=grpc", "OTEL_SERVICE_NAME=idemq-demo-"+suffix)
	p := start(t, "demo", environ, "demo", "--payments", "60", "--http-payments", "-1", "--workers", "1", "--concurrency", "4",
		"--no-kill", "--demo-schema", schema, "--queue", queue, "--log-dir", t.TempDir(), "--ui", "--ui-listen", "127.0.0.1:0")

	printed := regexp.MustCompile(`a duplicate: +(http://\S+/trace\?id=([0-9a-f]{32}))\n +its original: +(http://\S+/trace\?id=([0-9a-f]{32}))\n +all duplicates: +(http://\S+/duplicates)`)
	var m []string
	testenv.Poll(t, 3*time.Minute, func(context.Context) bool {
		m = printed.FindStringSubmatch(p.stderr.String())
		select {
		case <-p.done:
			t.Fatalf("the demo ended (%d) before printing the UI's links:\n%s", p.code, p.stderr.String())
		default:
		}
		return m != nil
	}, func() string { return "the UI's links in the demo's output:\n" + p.stderr.String() })
	out := p.stderr.String()
	if !strings.Contains(out, "(both traces found in Jaeger, the link checked)") || !strings.Contains(out, "serves its query API but no UI") {
		t.Errorf("the report's Jaeger line:\n%s", out)
	}
	dupURL, dupTrace, origURL, origTrace, dupsURL := m[1], m[2], m[3], m[4], m[5]

	get := func(u string) string {
		t.Helper()
		resp, err := http.Get(u)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s: %d\n%s", u, resp.StatusCode, b)
		}
		return string(b)
	}
	page := get(dupURL)
	for _, want := range []string{"Trace " + dupTrace, queue + " process", "<b>duplicate of</b>", `href="/trace?id=` + origTrace + `#span-`} {
		if !strings.Contains(page, want) {
			t.Fatalf("the duplicate's page lacks %q:\n%s", want, page)
		}
	}
	page = get(origURL)
	// The process span and its handler's (reserve and complete are in a
	// group's trace when the worker claims several keys at once).
	for _, want := range []string{"Trace " + origTrace, queue + " process", "idemq handler"} {
		if !strings.Contains(page, want) {
			t.Fatalf("the original's page lacks %q:\n%s", want, page)
		}
	}
	if !strings.Contains(page, `<span class="outcome outcome-processed">processed</span>`) && !strings.Contains(page, `<span class="outcome outcome-rejected">rejected</span>`) {
		t.Fatalf("the original's page shows no processing:\n%s", page)
	}
	if strings.Contains(page, "<b>duplicate of</b>") {
		t.Errorf("the original's page shows a duplicate:\n%s", page)
	}
	page = get(dupsURL)
	for _, want := range []string{`id="scope-payments"`, `href="/trace?id=` + dupTrace, `href="/trace?id=` + origTrace} {
		if !strings.Contains(page, want) {
			t.Fatalf("the Duplicates page lacks %q:\n%s", want, page)
		}
	}
	p.signal(t, syscall.SIGINT)
	if code := p.wait(t, 30*time.Second); code != 0 {
		t.Fatalf("demo exit %d:\n%s", code, p.stderr.String())
	}
}

// `idemq ui --jaeger-url` refuses what is not a base URL (exit 2), and
// prints the Duplicates page's link once it listens.
func TestUIJaegerURL(t *testing.T) {
	t.Parallel()
	schema := newSchema(t)
	if r := idemq(t, env(schema), "ui", "--listen", "127.0.0.1:0", "--jaeger-url", "127.0.0.1:16686"); r.code != 2 || !strings.Contains(r.stderr, "--jaeger-url") {
		t.Fatalf("ui --jaeger-url without a scheme: %s", r)
	}
	p := start(t, "ui", env(schema, "IDEMQ_JAEGER_URL=http://127.0.0.1:1/"), "ui", "--listen", "127.0.0.1:0")
	addr := waitServing(t, p)
	want := "duplicates and traces from Jaeger at http://127.0.0.1:1: http://" + addr + "/duplicates"
	testenv.Poll(t, 10*time.Second, func(context.Context) bool { return strings.Contains(p.stderr.String(), want) },
		func() string { return "want " + want + " in:\n" + p.stderr.String() })
	p.signal(t, syscall.SIGTERM)
	if code := p.wait(t, 15*time.Second); code != 0 {
		t.Fatalf("ui exit %d:\n%s", code, p.stderr.String())
	}
}
