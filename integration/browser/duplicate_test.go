package browser_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/internal/testjaeger"
)

// A person after `idemq demo --ui`, its spans in a real Jaeger that has no
// UI of its own: the Duplicates page lists a suppressed duplicate; its trace
// opens, says what it duplicated, and the link to the original opens the
// original's spans, with its outcome. No other tool.
func TestOperatorFollowsADuplicate(t *testing.T) {
	j := testjaeger.Start(t)
	suffix := testdb.RandomHex(4)
	schema, queue := "idemq_demo_browser_"+suffix, "idemq.demo.browser."+suffix
	pool := testdb.Pool(t, 2)
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+schema+" CASCADE") })
	queues := []string{queue, queue + ".dlq"}
	for _, d := range []string{"200ms", "400ms", "800ms"} {
		queues = append(queues, queue+".retry."+d)
	}
	testamqp.DeleteQueuesAtCleanup(t, queues, []string{queue + ".dlx"})

	cmd := exec.Command(binary, "demo", "--payments", "60", "--http-payments", "-1", "--workers", "1", "--concurrency", "4",
		"--no-kill", "--demo-schema", schema, "--queue", queue, "--log-dir", t.TempDir(), "--ui", "--ui-listen", "127.0.0.1:0")
	cmd.Env = append(os.Environ(), "IDEMQ_POSTGRES_URL="+testdb.URL(), "IDEMQ_AMQP_URL="+testamqp.URL(),
		"IDEMQ_JAEGER_URL="+j.Query, "OTEL_EXPORTER_OTLP_ENDPOINT=http://"+j.OTLP, "OTEL_EXPORTER_OTLP_PROTOCOL=grpc",
		"OTEL_SERVICE_NAME=idemq-demo-"+suffix)
	var out bytes.Buffer
	var mu sync.Mutex
	w := writerFunc(func(p []byte) (int, error) { mu.Lock(); defer mu.Unlock(); return out.Write(p) })
	cmd.Stdout, cmd.Stderr = w, w
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGINT)
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			mu.Lock()
			t.Logf("demo output:\n%s", out.String())
			mu.Unlock()
		}
	})
	printed := regexp.MustCompile(`all duplicates: +(http://\S+/duplicates)`)
	var dups string
	deadline := time.Now().Add(3 * time.Minute)
	for dups == "" {
		mu.Lock()
		if m := printed.FindStringSubmatch(out.String()); m != nil {
			dups = m[1]
		}
		mu.Unlock()
		select {
		case <-done:
			t.Fatal("the demo ended before printing the UI's links")
		case <-time.After(100 * time.Millisecond): // polling its output: nothing to wait on
		}
		if dups == "" && time.Now().After(deadline) {
			t.Fatal("the demo printed no link to the Duplicates page within 3 minutes")
		}
	}

	ctx := browser(t)
	shots := screenshotDir(t)
	var list string
	run(t, ctx, "open the Duplicates page",
		chromedp.Navigate(dups),
		chromedp.WaitVisible(chromedp.CSS(`#scope-payments`)),
		chromedp.WaitVisible(chromedp.CSS(`tr.dup a.dup-trace`)),
		textOf(&list, `#dup-count`),
	)
	if !strings.Contains(list, "duplicate(s) in the last") || strings.HasPrefix(list, "0 ") {
		t.Fatalf("duplicates: %q", list)
	}
	shot(t, ctx, shots, "ui-duplicates.png")

	// A duplicate whose original Jaeger holds: its row links the original.
	run(t, ctx, "open a duplicate's trace",
		chromedp.Click(chromedp.CSS(`tr.dup:has(a.orig-trace) a.dup-trace`)),
		chromedp.WaitVisible(chromedp.CSS(`#spans tr.span.duplicate`)),
	)
	var dup string
	run(t, ctx, "read what it duplicated", textOf(&dup, `#spans`))
	if !strings.Contains(dup, "duplicate of") || !strings.Contains(dup, queue+" process") {
		t.Fatalf("the duplicate's trace: %q", dup)
	}
	shot(t, ctx, shots, "ui-trace-duplicate.png")

	var orig string
	run(t, ctx, "follow the link to the original",
		chromedp.Click(chromedp.CSS(`#spans tr.detail.duplicate div.link a.ref`)),
		chromedp.WaitVisible(chromedp.CSS(`#spans tr.span`)),
		textOf(&orig, `#spans`),
	)
	if !strings.Contains(orig, "idemq handler") || !(strings.Contains(orig, "processed") || strings.Contains(orig, "rejected")) || strings.Contains(orig, "duplicate of") {
		t.Fatalf("the original's trace: %q", orig)
	}
	shot(t, ctx, shots, "ui-trace-original.png")
}
