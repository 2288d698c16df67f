package ui_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/cmd/idemq/internal/jaeger/jaegertest"
	"github.com/idemq/idemq/cmd/idemq/internal/ui"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/internal/testenv"
)

// jaegerWait bounds each wait for the spans flushed to show in the pages.
const jaegerWait = 30 * time.Second

// TestDuplicatesFromJaeger produces a real duplicate through a consumer
// whose spans go to a real Jaeger (OTLP), then reads it through the UI:
// the Duplicates page lists it in its scope with both traces, the trace
// page of the duplicate links to the original's trace, and that page shows
// the original's spans. No raw key appears anywhere.
func TestDuplicatesFromJaeger(t *testing.T) {
	t.Parallel()
	j := jaegertest.Start(t)
	te := testenv.New(t)
	service := "idemq-test-ui-" + testdb.RandomHex(4)
	tp := j.TracerProvider(t, service)
	cfg, events := te.ConsumerConfig("idemq-test-ui-dup", "charge-ui")
	cfg.TracerProvider = tp
	// The raw key on the spans (idemq.key): the pages must still hide it.
	cfg.LogKeys = true
	te.Run(cfg, func(context.Context, pgx.Tx, *consumer.Delivery) (consumer.Response, error) {
		return consumer.Response{Code: 201}, nil
	})
	const key = "pay-ui-secret-42"
	te.Publish(cfg.Queue, key, `{"amount":10}`, nil)
	orig := testenv.WaitOutcome(t, events, consumer.OutcomeProcessed)
	te.Publish(cfg.Queue, key, `{"amount":10}`, nil)
	dup := testenv.WaitOutcome(t, events, consumer.OutcomeDuplicate)
	if dup.OriginalTraceID != orig.TraceID || dup.TraceID == orig.TraceID {
		t.Fatalf("duplicate %s of %s, want a trace of its own linking to %s", dup.TraceID, dup.OriginalTraceID, orig.TraceID)
	}
	flushCtx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := tp.ForceFlush(flushCtx); err != nil {
		t.Fatalf("flush spans to jaeger: %v", err)
	}

	e := newEnv(t, func(c *ui.Config) { c.JaegerURL = j.Query; c.Schema = te.Schema })

	// The Duplicates page: the duplicate in its scope, both traces linked.
	var p page
	testenv.Poll(t, jaegerWait, func(context.Context) bool {
		p = e.get("/duplicates?service=" + service)
		return p.code == http.StatusOK && strings.Contains(p.body, dup.TraceID) && strings.Contains(p.body, ">processed<")
	}, func() string { return fmt.Sprintf("/duplicates (%d):\n%s", p.code, p.body) })
	mustContain(t, p,
		`id="scope-charge-ui"`, dup.KeyHash, "1 duplicate(s)",
		`href="/trace?id=`+dup.TraceID+`#span-`, `href="/trace?id=`+orig.TraceID+`#span-`,
		`<b class="outcome-processed">processed</b>`, cfg.Queue+" process", service,
		"serves no UI of its own", // the local Jaeger has no UI assets
	)
	mustNotContain(t, p, key, "in Jaeger</a>", "Jaeger could not be read")
	// Every service (the default) finds it too.
	mustContain(t, e.get("/duplicates?lookback=15m"), dup.TraceID)
	if n := strings.Count(p.body, `class="dup"`); n != 1 {
		t.Errorf("%d duplicates listed, want 1", n)
	}

	// The duplicate's trace: its span, marked, with the link to the original.
	p = e.get("/trace?id=" + dup.TraceID)
	mustContain(t, p, "Trace "+dup.TraceID, cfg.Queue+" process", `<span class="outcome outcome-duplicate">duplicate</span>`,
		"<b>duplicate of</b>", "idemq.duplicate_suppressed", "idemq.original.trace_id", orig.TraceID, dup.KeyHash,
		"idemq.key</dt><dd>sha256:", `<svg class="bar"`)
	mustNotContain(t, p, key, `id="open-in-jaeger"`)
	link := regexp.MustCompile(`<a class="ref" href="(/trace\?id=` + orig.TraceID + `#span-[0-9a-f]{16})">`).FindStringSubmatch(p.body)
	if link == nil {
		t.Fatalf("no link to the original's trace in:\n%s", p.body)
	}

	// Following it: the original's spans, the process span and its children.
	p = e.get(link[1])
	if p.code != http.StatusOK {
		t.Fatalf("GET %s: %d\n%s", link[1], p.code, p.body)
	}
	spanID := link[1][strings.Index(link[1], "#span-")+len("#span-"):]
	mustContain(t, p, "Trace "+orig.TraceID, `id="span-`+spanID+`"`, cfg.Queue+" process",
		"idemq reserve", "idemq handler", "idemq complete", `<span class="outcome outcome-processed">processed</span>`,
		"idemq.consumer</dt><dd>charge-ui", service)
	mustNotContain(t, p, key, "duplicate of")

	// A Jaeger that serves its UI (here: the real one's API behind a proxy
	// that serves a page at /): "open in Jaeger" beside the UI's links.
	withUI := jaegerWithUI(t, j.Query)
	e = newEnv(t, func(c *ui.Config) { c.JaegerURL = withUI })
	p = e.get("/trace?id=" + dup.TraceID)
	mustContain(t, p, `id="open-in-jaeger" href="`+withUI+`/trace/`+dup.TraceID+`"`)
	p = e.get("/duplicates?service=" + service)
	mustContain(t, p, `href="`+withUI+`/trace/`+orig.TraceID+`" rel="noreferrer">in Jaeger</a>`, `href="/trace?id=`+orig.TraceID+`#span-`)
	mustNotContain(t, p, "serves no UI of its own")

	// With --show-keys, the raw key is shown.
	shown := newEnv(t, func(c *ui.Config) { c.JaegerURL = j.Query; c.ShowKeys = true })
	mustContain(t, shown.get("/trace?id="+dup.TraceID), "idemq.key</dt><dd>"+key)
	mustContain(t, shown.get("/duplicates?service="+service), key)
}

// jaegerWithUI is a Jaeger with its UI: query's API behind a proxy that
// serves a page of its own at /.
func jaegerWithUI(t *testing.T, query string) string {
	t.Helper()
	target, err := url.Parse(query)
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	tr := &http.Transport{}
	proxy.Transport = tr
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/api/") {
			proxy.ServeHTTP(w, r)
			return
		}
		_, _ = w.Write([]byte(`<!doctype html><html><head><title>Jaeger UI</title></head><body><div id="jaeger-ui-root"></div></body></html>`))
	}))
	t.Cleanup(func() { srv.Close(); tr.CloseIdleConnections() })
	return srv.URL
}

// TestDuplicatesWithoutJaeger: without --jaeger-url the pages say how to
// give one; a Jaeger that does not answer is a line on a whole page; a
// trace id must be 32 hex digits; a trace Jaeger lacks is a 404 page.
func TestDuplicatesWithoutJaeger(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	p := e.get("/duplicates")
	if p.code != http.StatusOK {
		t.Fatalf("/duplicates: %d", p.code)
	}
	mustContain(t, p, `id="no-jaeger"`, "--jaeger-url http://127.0.0.1:16686", "IDEMQ_JAEGER_URL", `<a href="/duplicates">Duplicates</a>`)
	mustContain(t, e.get("/trace?id=4bf92f3577b34da6a3ce929d0e0e4736"), `id="no-jaeger"`)

	down := newEnv(t, func(c *ui.Config) { c.JaegerURL = "http://127.0.0.1:1" })
	p = down.get("/duplicates")
	if p.code != http.StatusBadGateway {
		t.Errorf("/duplicates with Jaeger down: %d, want 502", p.code)
	}
	mustContain(t, p, `id="jaeger-error"`, "Jaeger could not be read", `<a href="/keys">Key lookup</a>`)
	p = down.get("/trace?id=4bf92f3577b34da6a3ce929d0e0e4736")
	if p.code != http.StatusBadGateway {
		t.Errorf("/trace with Jaeger down: %d, want 502", p.code)
	}
	mustContain(t, p, `id="trace-error"`, `<a href="/keys">Key lookup</a>`)

	for _, bad := range []string{"", "4bf92f3577b34da6", "4bf92f3577b34da6a3ce929d0e0e47zz", "..%2F..%2Fapi%2Fservices", "00000000000000000000000000000000"} {
		if p := down.get("/trace?id=" + bad); p.code != http.StatusBadRequest || !strings.Contains(p.body, "32 hex digits") {
			t.Errorf("/trace?id=%s: %d, want 400", bad, p.code)
		}
	}
	if _, err := ui.New(ui.Config{Pool: e.cfg.Pool, Dial: e.cfg.Dial, JaegerURL: "127.0.0.1:16686"}); err == nil {
		t.Error("a Jaeger URL without a scheme was accepted")
	}
}

// TestTraceNotInJaeger: a trace the Jaeger does not hold is a page saying
// so, 404.
func TestTraceNotInJaeger(t *testing.T) {
	t.Parallel()
	j := jaegertest.Start(t)
	e := newEnv(t, func(c *ui.Config) { c.JaegerURL = j.Query })
	p := e.get("/trace?id=" + testdb.RandomHex(16))
	if p.code != http.StatusNotFound {
		t.Fatalf("unknown trace: %d, want 404\n%s", p.code, p.body)
	}
	mustContain(t, p, `id="not-found"`)
}

// TestKeyPageLinksTheTracePage: with a Jaeger, the key page links the
// first processing's trace to the UI's trace page, beside Jaeger's link.
func TestKeyPageLinksTheTracePage(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *ui.Config) { c.JaegerURL = "http://127.0.0.1:1" })
	e.complete("order-7", dedup.Result{Outcome: dedup.OutcomeOK})
	p := e.get("/keys?consumer=" + consumerName + "&key=order-7")
	mustContain(t, p, `href="/trace?id=4bf92f3577b34da6a3ce929d0e0e4736"`, `href="http://127.0.0.1:1/trace/4bf92f3577b34da6a3ce929d0e0e4736"`)
}

// TestDuplicatesBehindTheDoors: the two pages are behind the UI's Host
// guard and token like every page, with its strict CSP.
func TestDuplicatesBehindTheDoors(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *ui.Config) { c.Token = token; c.JaegerURL = "http://127.0.0.1:1" })
	for _, path := range []string{"/duplicates", "/trace?id=4bf92f3577b34da6a3ce929d0e0e4736"} {
		if p := e.get(path); p.code != http.StatusSeeOther || !strings.HasPrefix(p.location, "/login?next=") {
			t.Errorf("GET %s without the token: %d %q", path, p.code, p.location)
		}
		req, _ := http.NewRequest(http.MethodGet, e.srv.URL+path, nil)
		req.Header.Set("Authorization", "Bearer "+token)
		req.Host = "rebound.example"
		if p := e.do(req); p.code != http.StatusMisdirectedRequest {
			t.Errorf("GET %s for another host: %d", path, p.code)
		}
		req, _ = http.NewRequest(http.MethodGet, e.srv.URL+path, nil)
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := e.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadGateway || !strings.Contains(resp.Header.Get("Content-Security-Policy"), "default-src 'none'") {
			t.Errorf("GET %s with the token: %d, CSP %q", path, resp.StatusCode, resp.Header.Get("Content-Security-Policy"))
		}
	}
}

// sameTraceRetry is an HTTP client's trace as Jaeger's API gives it: the
// client's span, its first request (processed) and its retry, a suppressed
// duplicate whose link points into the same trace.
const sameTraceRetry = `{"data":[{"traceID":"5b8efff798038103d269b633813fc60c","spans":[
{"traceID":"5b8efff798038103d269b633813fc60c","spanID":"aaaaaaaaaaaaaaaa","operationName":"checkout POST","references":[],
 "startTime":1796028489000000,"duration":900000,"tags":[{"key":"span.kind","type":"string","value":"client"}],"logs":[],"processID":"p1"},
{"traceID":"5b8efff798038103d269b633813fc60c","spanID":"bbbbbbbbbbbbbbbb","operationName":"idemq request",
 "references":[{"refType":"CHILD_OF","traceID":"5b8efff798038103d269b633813fc60c","spanID":"aaaaaaaaaaaaaaaa"}],
 "startTime":1796028489100000,"duration":300000,"tags":[{"key":"idemq.outcome","type":"string","value":"processed"},
 {"key":"idemq.consumer","type":"string","value":"orders-api"},{"key":"idemq.key_hash","type":"string","value":"0123456789ab"}],"logs":[],"processID":"p2"},
{"traceID":"5b8efff798038103d269b633813fc60c","spanID":"cccccccccccccccc","operationName":"idemq request",
 "references":[{"refType":"CHILD_OF","traceID":"5b8efff798038103d269b633813fc60c","spanID":"aaaaaaaaaaaaaaaa"},
  {"refType":"FOLLOWS_FROM","traceID":"5b8efff798038103d269b633813fc60c","spanID":"bbbbbbbbbbbbbbbb"}],
 "startTime":1796028489600000,"duration":2000,"tags":[{"key":"idemq.outcome","type":"string","value":"duplicate"},
 {"key":"idemq.consumer","type":"string","value":"orders-api"},{"key":"idemq.key_hash","type":"string","value":"0123456789ab"},
 {"key":"idemq.tenant","type":"string","value":"acme"},{"key":"otel.status_code","type":"string","value":"ERROR"}],
 "logs":[{"timestamp":1796028489601000,"fields":[{"key":"event","type":"string","value":"idemq.duplicate_suppressed"},
  {"key":"idemq.original.completed_at","type":"string","value":"2026-12-01T10:00:00Z"}]}],"processID":"p2"}],
"processes":{"p1":{"serviceName":"shop"},"p2":{"serviceName":"orders"}},"warnings":null}],"errors":null}`

// TestDuplicateInItsOwnTrace: an HTTP retry in the trace of the request it
// repeats links within the page; a service Jaeger fails to search is a
// note, the others are listed (a Jaeger v2 answer recorded above).
func TestDuplicateInItsOwnTrace(t *testing.T) {
	t.Parallel()
	fake := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.URL.Path == "/api/services":
			_, _ = w.Write([]byte(`{"data":["broken","orders","shop"],"errors":null}`))
		case r.URL.Path == "/api/traces" && r.FormValue("service") == "broken":
			w.WriteHeader(http.StatusInternalServerError)
			_, _ = w.Write([]byte(`{"data":null,"errors":[{"code":500,"msg":"storage on fire"}]}`))
		case r.URL.Path == "/api/traces" && r.FormValue("service") == "orders",
			r.URL.Path == "/api/traces/5b8efff798038103d269b633813fc60c":
			_, _ = w.Write([]byte(sameTraceRetry))
		case r.URL.Path == "/api/traces":
			_, _ = w.Write([]byte(`{"data":[],"errors":null}`))
		default:
			w.WriteHeader(http.StatusNotFound)
		}
	}))
	t.Cleanup(fake.Close)
	e := newEnv(t, func(c *ui.Config) { c.JaegerURL = fake.URL })
	p := e.get("/duplicates?lookback=48h")
	if p.code != http.StatusOK {
		t.Fatalf("/duplicates: %d\n%s", p.code, p.body)
	}
	mustContain(t, p, `id="scope-orders-api"`, "0123456789ab", "<td>acme</td>", "storage on fire",
		`<b class="outcome-processed">processed</b>`, "(the same trace)", `href="/trace?id=5b8efff798038103d269b633813fc60c#span-bbbbbbbbbbbbbbbb"`)
	p = e.get("/trace?id=5b8efff798038103d269b633813fc60c")
	mustContain(t, p, `<a class="ref" href="#span-bbbbbbbbbbbbbbbb">span bbbbbbbbbbbbbbbb of this trace</a>`,
		`<td class="depth-0"><b>checkout POST</b>`, `<td class="depth-1"><b>idemq request</b>`, "shop, orders",
		`<span class="error">error</span>`, "+600ms", "900ms", `<rect x="666" y="0" width="2"`)
}
