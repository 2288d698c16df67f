package jaeger_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/cmd/idemq/internal/jaeger"
)

// v2Dup is a duplicate's trace as Jaeger v2.13 answers /api/traces/{id}
// (the shape recorded in deploy/jaeger/README.md): 32-hex ids, the parent
// and the span link as references, the duplicate's event as a log.
const v2Dup = `{"data":[{"traceID":"0d503346fc68803666d3d74d6a7246c6","spans":[
{"traceID":"0d503346fc68803666d3d74d6a7246c6","spanID":"cff0efd22eea851a","operationName":"payments process",
 "references":[{"refType":"FOLLOWS_FROM","traceID":"3cf3275e53d1d94a76fd46cf243a6391","spanID":"01145773e4a0d5b4"}],
 "startTime":1796028489119455,"duration":1500,
 "tags":[{"key":"idemq.outcome","type":"string","value":"duplicate"},{"key":"idemq.consumer","type":"string","value":"charge"},
  {"key":"idemq.tenant","type":"string","value":"acme"},{"key":"idemq.key_hash","type":"string","value":"9f86d081884c"},
  {"key":"idemq.attempt","type":"int64","value":2},{"key":"span.kind","type":"string","value":"consumer"}],
 "logs":[{"timestamp":1796028489120000,"fields":[{"key":"event","type":"string","value":"idemq.duplicate_suppressed"},
  {"key":"idemq.original.trace_id","type":"string","value":"3cf3275e53d1d94a76fd46cf243a6391"},
  {"key":"idemq.original.completed_at","type":"string","value":"2026-12-01T10:00:00.5Z"}]}],
 "processID":"p1","warnings":null},
{"traceID":"0d503346fc68803666d3d74d6a7246c6","spanID":"00000000000000aa","operationName":"idemq reserve",
 "references":[{"refType":"CHILD_OF","traceID":"0d503346fc68803666d3d74d6a7246c6","spanID":"cff0efd22eea851a"}],
 "startTime":1796028489119600,"duration":300,
 "tags":[{"key":"otel.status_code","type":"string","value":"ERROR"},{"key":"otel.status_description","type":"string","value":"boom"}],
 "logs":[],"processID":"p1","warnings":null}],
"processes":{"p1":{"serviceName":"idemq","tags":[]}},"warnings":null}],"total":0,"limit":0,"offset":0,"errors":null}`

// v1Dup is the same trace as Jaeger v1 writes it: leading zeros of the
// ids dropped, the parent as parentSpanID, the process inline, null
// references, an OpenTracing error tag.
const v1Dup = `{"data":[{"traceID":"d503346fc68803666d3d74d6a7246c6","spans":[
{"traceID":"d503346fc68803666d3d74d6a7246c6","spanID":"cff0efd22eea851a","operationName":"payments process",
 "references":[{"refType":"FOLLOWS_FROM","traceID":"3cf3275e53d1d94a76fd46cf243a6391","spanID":"1145773e4a0d5b4"}],
 "startTime":1796028489119455,"duration":1500,"flags":1,
 "tags":[{"key":"idemq.outcome","type":"string","value":"duplicate"},{"key":"idemq.consumer","type":"string","value":"charge"}],
 "logs":null,"process":{"serviceName":"idemq-v1","tags":[]}},
{"traceID":"d503346fc68803666d3d74d6a7246c6","spanID":"aa","parentSpanID":"cff0efd22eea851a","operationName":"idemq reserve",
 "references":null,"startTime":1796028489119600,"duration":300,
 "tags":[{"key":"error","type":"bool","value":true}],"logs":[],"process":{"serviceName":"idemq-v1"}}],
"processes":null,"warnings":null}],"total":0,"limit":0,"offset":0,"errors":null}`

// api serves path → body; other paths get Jaeger's 404.
func api(t *testing.T, answers map[string]string) (*jaeger.Client, *[]string) {
	t.Helper()
	var asked []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		asked = append(asked, r.URL.RequestURI())
		if b, ok := answers[r.URL.Path]; ok {
			_, _ = w.Write([]byte(b))
			return
		}
		w.WriteHeader(http.StatusNotFound)
		_, _ = w.Write([]byte(`{"data":null,"total":0,"limit":0,"offset":0,"errors":[{"code":404,"msg":"trace not found"}]}`))
	}))
	t.Cleanup(srv.Close)
	c, err := jaeger.New(srv.URL+"/", nil)
	if err != nil {
		t.Fatal(err)
	}
	return c, &asked
}

func TestTraceV2(t *testing.T) {
	t.Parallel()
	c, _ := api(t, map[string]string{"/api/traces/0d503346fc68803666d3d74d6a7246c6": v2Dup})
	tr, err := c.Trace(context.Background(), "0D503346FC68803666D3D74D6A7246C6")
	if err != nil {
		t.Fatal(err)
	}
	if tr.ID != "0d503346fc68803666d3d74d6a7246c6" || len(tr.Spans) != 2 {
		t.Fatalf("trace %s with %d spans", tr.ID, len(tr.Spans))
	}
	p, r := tr.Spans[0], tr.Spans[1]
	if p.Name != "payments process" || p.Service != "idemq" || p.ParentID != "" || p.Kind() != "consumer" {
		t.Errorf("process span %+v", p)
	}
	if !p.Start.Equal(time.UnixMicro(1796028489119455)) || p.Duration != 1500*time.Microsecond {
		t.Errorf("start %v duration %v", p.Start, p.Duration)
	}
	if v, _ := p.Tag("idemq.attempt"); v != "2" {
		t.Errorf("idemq.attempt %q, want 2", v)
	}
	if r.ParentID != p.SpanID || len(r.Refs) != 0 {
		t.Errorf("reserve: parent %q refs %v", r.ParentID, r.Refs)
	}
	if st, desc := r.Status(); st != "error" || desc != "boom" {
		t.Errorf("reserve status %q %q", st, desc)
	}
	if len(p.Events) != 1 || p.Events[0].Name != "idemq.duplicate_suppressed" {
		t.Fatalf("events %+v", p.Events)
	}
	dups := tr.Duplicates()
	if len(dups) != 1 {
		t.Fatalf("duplicates %+v", dups)
	}
	d := dups[0]
	if d.Consumer != "charge" || d.Tenant != "acme" || d.KeyHash != "9f86d081884c" ||
		d.OriginalTrace != "3cf3275e53d1d94a76fd46cf243a6391" || d.OriginalSpan != "01145773e4a0d5b4" ||
		!d.OriginalCompleted.Equal(time.Date(2026, 12, 1, 10, 0, 0, 5e8, time.UTC)) {
		t.Errorf("duplicate %+v", d)
	}
	if tree := tr.Tree(); len(tree) != 2 || tree[0].Span != &tr.Spans[0] || tree[1].Depth != 1 {
		t.Errorf("tree %+v", tree)
	}
}

func TestTraceV1(t *testing.T) {
	t.Parallel()
	c, asked := api(t, map[string]string{"/api/traces/0d503346fc68803666d3d74d6a7246c6": v1Dup})
	tr, err := c.Trace(context.Background(), "d503346fc68803666d3d74d6a7246c6")
	if err != nil {
		t.Fatal(err)
	}
	if (*asked)[0] != "/api/traces/0d503346fc68803666d3d74d6a7246c6" {
		t.Errorf("asked %v", *asked)
	}
	if tr.ID != "0d503346fc68803666d3d74d6a7246c6" || len(tr.Spans) != 2 {
		t.Fatalf("trace %s with %d spans", tr.ID, len(tr.Spans))
	}
	p, r := tr.Spans[0], tr.Spans[1]
	if p.Service != "idemq-v1" || r.SpanID != "00000000000000aa" || r.ParentID != p.SpanID {
		t.Errorf("spans %+v %+v", p, r)
	}
	if st, _ := r.Status(); st != "error" {
		t.Errorf("status %q, want error from the error tag", st)
	}
	d := tr.Duplicates()
	if len(d) != 1 || d[0].OriginalTrace != "3cf3275e53d1d94a76fd46cf243a6391" || d[0].OriginalSpan != "01145773e4a0d5b4" {
		t.Errorf("duplicates %+v", d)
	}
}

func TestTraceNotFound(t *testing.T) {
	t.Parallel()
	c, _ := api(t, nil)
	_, err := c.Trace(context.Background(), "3cf3275e53d1d94a76fd46cf243a6391")
	if !errors.Is(err, jaeger.ErrNotFound) {
		t.Fatalf("err %v, want ErrNotFound", err)
	}
	for _, bad := range []string{"", "xyz", strings.Repeat("a", 33), strings.Repeat("0", 32), "../../api/services"} {
		if _, err := c.Trace(context.Background(), bad); err == nil || errors.Is(err, jaeger.ErrNotFound) {
			t.Errorf("id %q: %v, want a refusal", bad, err)
		}
	}
}

func TestFind(t *testing.T) {
	t.Parallel()
	c, asked := api(t, map[string]string{"/api/traces": v2Dup, "/api/services": `{"data":["idemq","jaeger"],"total":2,"limit":0,"offset":0,"errors":null}`})
	svcs, err := c.Services(context.Background())
	if err != nil || strings.Join(svcs, ",") != "idemq,jaeger" {
		t.Fatalf("services %v, %v", svcs, err)
	}
	end := time.UnixMicro(1796028500000000)
	trs, err := c.Find(context.Background(), jaeger.Query{Service: "idemq", Tags: jaeger.DuplicateTags(), Start: end.Add(-time.Hour), End: end, Limit: 20})
	if err != nil || len(trs) != 1 || len(trs[0].Duplicates()) != 1 {
		t.Fatalf("find: %v, %v", trs, err)
	}
	want := "/api/traces?end=1796028500000000&limit=20&service=idemq&start=1796024900000000&tags=%7B%22idemq.outcome%22%3A%22duplicate%22%7D"
	if (*asked)[1] != want {
		t.Errorf("asked %s\nwant  %s", (*asked)[1], want)
	}
}

func TestErrorsAndBounds(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/api/services":
			w.WriteHeader(http.StatusBadRequest)
			_, _ = w.Write([]byte(`{"data":null,"errors":[{"code":400,"msg":"bad thing"}]}`))
		case "/api/traces":
			_, _ = w.Write([]byte(`{"data":[` + strings.Repeat(" ", 2048) + `]}`))
		case "/":
			_, _ = w.Write([]byte("<html><body>" + jaeger.Placeholder + "!</body></html>"))
		}
	}))
	t.Cleanup(srv.Close)
	c, err := jaeger.New(srv.URL, &jaeger.Config{MaxBody: 1024})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Services(context.Background()); err == nil || !strings.Contains(err.Error(), "bad thing") {
		t.Errorf("services: %v, want Jaeger's message", err)
	}
	if _, err := c.Find(context.Background(), jaeger.Query{Service: "x"}); err == nil || !strings.Contains(err.Error(), "larger than 1024") {
		t.Errorf("find: %v, want the body bound", err)
	}
	if ui, err := c.HasUI(context.Background()); ui || err != nil {
		t.Errorf("placeholder: has UI %v, %v", ui, err)
	}
	down, _ := jaeger.New("http://127.0.0.1:1", &jaeger.Config{Timeout: time.Second})
	if _, err := down.Services(context.Background()); err == nil {
		t.Error("a Jaeger that is down answered")
	}
	for _, bad := range []string{"", "127.0.0.1:16686", "ftp://x", "http://x/?q=1"} {
		if _, err := jaeger.New(bad, nil); err == nil {
			t.Errorf("New(%q) accepted", bad)
		}
	}
}

func TestHasUI(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write([]byte(`<!doctype html><html><head><title>Jaeger UI</title></head><body><div id="jaeger-ui-root"></div></body></html>`))
	}))
	t.Cleanup(srv.Close)
	c, _ := jaeger.New(srv.URL, nil)
	if ui, err := c.HasUI(context.Background()); !ui || err != nil {
		t.Errorf("has UI %v, %v", ui, err)
	}
	if got := c.UITraceURL("ab"); got != srv.URL+"/trace/ab" {
		t.Errorf("UI trace URL %s", got)
	}
	if got := jaeger.TracePageURL("http://127.0.0.1:8089/", "ab"); got != "http://127.0.0.1:8089/trace?id=ab" {
		t.Errorf("trace page URL %s", got)
	}
}

// TestRecordedV2 reads answers recorded from the local Jaeger v2.13 of
// deploy/jaeger (testdata/, from TestDuplicatesFromJaeger of package ui):
// the search for duplicates of a service, and the original's trace.
func TestRecordedV2(t *testing.T) {
	t.Parallel()
	read := func(name string) string {
		b, err := os.ReadFile(filepath.Join("testdata", name))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	const orig = "86615c94edc83e5b123eff83bfbff179"
	c, _ := api(t, map[string]string{"/api/traces": read("v2-find-duplicates.json"), "/api/traces/" + orig: read("v2-trace-original.json")})
	found, err := c.Find(context.Background(), jaeger.Query{Service: "idemq-test-ui-4085d671", Tags: jaeger.DuplicateTags()})
	if err != nil || len(found) != 1 {
		t.Fatalf("find: %d traces, %v", len(found), err)
	}
	dups := found[0].Duplicates()
	if len(dups) != 1 {
		t.Fatalf("duplicates %+v", dups)
	}
	d := dups[0]
	if d.Consumer != "charge-ui" || d.KeyHash == "" || d.OriginalTrace != orig || d.OriginalSpan == "" || d.OriginalCompleted.IsZero() {
		t.Errorf("duplicate %+v", d)
	}
	if d.Span.Name != "idemq-test-ui-dup.0622fc0089 process" || d.Span.Service != "idemq-test-ui-4085d671" || d.Span.Kind() != "consumer" || d.Span.ParentID != "" {
		t.Errorf("duplicate's span %+v", d.Span)
	}
	if tree := found[0].Tree(); len(tree) != 2 || tree[0].Span != d.Span || tree[1].Name != "idemq reserve" || tree[1].Depth != 1 {
		t.Errorf("tree of the duplicate's trace: %+v", tree)
	}
	tr, err := c.Trace(context.Background(), orig)
	if err != nil {
		t.Fatal(err)
	}
	sp := tr.Span(d.OriginalSpan)
	if sp == nil {
		t.Fatalf("the original's span %s is not in its trace", d.OriginalSpan)
	}
	if o, _ := sp.Tag(jaeger.AttrOutcome); o != "processed" || sp.End().After(d.Span.Start) {
		t.Errorf("original %s outcome %q, ended %v, the duplicate started %v", sp.Name, o, sp.End(), d.Span.Start)
	}
	var names []string
	for _, s := range tr.Tree() {
		names = append(names, strings.Repeat(" ", s.Depth)+s.Name)
	}
	if got := strings.Join(names, ","); got != "idemq-test-ui-dup.0622fc0089 process, idemq reserve, idemq handler, idemq complete" {
		t.Errorf("the original's tree: %s", got)
	}
}
