package browser_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/internal/testjaeger"
)

var (
	// binary is the idemq binary under test, built by TestMain.
	binary string
	// chromium is the browser, found by TestMain.
	chromium string
)

func TestMain(m *testing.M) {
	var err error
	if chromium, err = findChromium(); err != nil {
		fmt.Fprintf(os.Stderr, "browser test: %v\n", err)
		os.Exit(1)
	}
	dir, err := os.MkdirTemp("", "idemq-browser-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "idemq")
	build := exec.Command("go", "build", "-o", binary, "github.com/idemq/idemq/cmd/idemq")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintf(os.Stderr, "build idemq: %v\n", err)
		os.Exit(1)
	}
	code := m.Run()
	testjaeger.Stop()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

// findChromium returns IDEMQ_CHROMIUM, else the first Chromium on PATH.
func findChromium() (string, error) {
	if p := os.Getenv("IDEMQ_CHROMIUM"); p != "" {
		if _, err := exec.LookPath(p); err != nil {
			return "", fmt.Errorf("IDEMQ_CHROMIUM=%s: %w", p, err)
		}
		return p, nil
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome", "google-chrome-stable"} {
		if p, err := exec.LookPath(name); err == nil {
			return p, nil
		}
	}
	return "", errors.New("no Chromium found (looked for IDEMQ_CHROMIUM, then chromium, chromium-browser, google-chrome on PATH): " +
		"run `make test`, which installs Debian's chromium where it can (deploy/local/ensure-chromium.sh), " +
		"or `apt-get install -y chromium`, or set IDEMQ_CHROMIUM to a Chromium binary")
}

const (
	consumerName = "payments"
	// key is the payment that fails, is dead-lettered, replayed and processed.
	key = "order-2026-1001"
)

// An operator opens the overview, finds a dead letter by its reason,
// replays it, sees it processed, and looks its key up.
func TestOperatorReplaysADeadLetter(t *testing.T) {
	e := testenv.New(t)
	cfg, events := e.ConsumerConfig("idemq-browser", consumerName)
	var failing atomic.Bool
	failing.Store(true)
	e.Run(cfg, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		if d.Key == key && failing.Load() {
			return consumer.Response{}, consumer.Permanent(errors.New("card issuer unavailable: 503 from acquirer"))
		}
		return consumer.Response{Code: 200, Body: []byte(`{"status":"charged","amount":4200}`)}, nil
	})
	// Two payments go through, one fails for good, one comes without a key.
	for _, k := range []string{"order-2026-0998", "order-2026-0999", key, ""} {
		e.Publish(cfg.Queue, k, `{"amount":4200,"currency":"EUR"}`, nil)
	}
	outcomes := map[consumer.Outcome]int{}
	for range 4 {
		outcomes[testenv.WaitEvent(t, events).Outcome]++
	}
	if outcomes[consumer.OutcomeProcessed] != 2 || outcomes[consumer.OutcomeDeadLettered]+outcomes[consumer.OutcomeInvalidKey] != 2 {
		t.Fatalf("outcomes before the replay: %v", outcomes)
	}
	// The issuer is back.
	failing.Store(false)

	base := startUI(t, e.Schema, cfg)
	ctx := browser(t)
	shots := screenshotDir(t)
	keyHash := dedup.Scope{Consumer: consumerName, Key: key}.KeyHash()

	// The overview: the scope's keys, the queue, its DLQ by reason.
	run(t, ctx, "open the overview",
		chromedp.Navigate(base+"/"),
		chromedp.WaitVisible(chromedp.CSS(`#scopes`)),
		chromedp.WaitVisible(chromedp.CSS(`a.reason[href*="reason=permanent_error"]`)),
	)
	shot(t, ctx, shots, "ui-overview.png")

	// Find the dead letter by its reason.
	var letters string
	run(t, ctx, "find the dead letter by its reason",
		chromedp.Click(chromedp.CSS(`a.reason[href*="reason=permanent_error"]`)),
		chromedp.WaitVisible(chromedp.CSS(`#letters`)),
		textOf(&letters, `#letters`),
	)
	if !strings.Contains(letters, keyHash) || !strings.Contains(letters, "card issuer unavailable") || strings.Contains(letters, key) {
		t.Fatalf("the dead letters list shows %q; want key hash %s and the error, not the raw key", letters, keyHash)
	}
	shot(t, ctx, shots, "ui-dead-letters.png")

	// Its headers and body.
	var body string
	run(t, ctx, "open the letter",
		chromedp.Click(chromedp.CSS(`#letters tr[data-reason="permanent_error"] a`)),
		chromedp.WaitVisible(chromedp.CSS(`#body`)),
		textOf(&body, `#body`),
	)
	if !strings.Contains(body, `"currency":"EUR"`) {
		t.Fatalf("letter body %q", body)
	}
	shot(t, ctx, shots, "ui-letter.png")

	// Replay it: choose it, confirm, watch the progress.
	run(t, ctx, "choose the letter and ask to replay it",
		chromedp.Navigate(base+"/dlq?queue="+cfg.Queue+"&reason=permanent_error"),
		chromedp.WaitVisible(chromedp.CSS(`#letters`)),
		chromedp.Click(chromedp.CSS(`#letters tr[data-reason="permanent_error"] input[type=checkbox]`)),
		chromedp.Click(chromedp.CSS(`#replay-selected`)),
		chromedp.WaitVisible(chromedp.CSS(`#confirm-replay`)),
	)
	shot(t, ctx, shots, "ui-replay-confirm.png")
	run(t, ctx, "confirm the replay", chromedp.Click(chromedp.CSS(`#confirm-replay`)))
	waitFor(t, ctx, "the replay to end", `document.querySelector('#job-state') && document.querySelector('#job-state').dataset.done === 'true'`)
	var state string
	run(t, ctx, "read the replay's result", textOf(&state, `#job-state`))
	if !strings.Contains(state, "Done.") || !strings.Contains(state, "replayed 1") {
		t.Fatalf("replay result %q", state)
	}
	shot(t, ctx, shots, "ui-replay-done.png")

	// The consumer processes the replayed copy.
	ev := testenv.WaitOutcome(t, events, consumer.OutcomeProcessed)
	if ev.KeyHash != keyHash {
		t.Fatalf("processed %s, want the replayed %s", ev.KeyHash, keyHash)
	}

	// The DLQ holds only the letter without a key now.
	var reasons string
	run(t, ctx, "see the DLQ without it",
		chromedp.Navigate(base+"/dlq?queue="+cfg.Queue),
		chromedp.WaitVisible(chromedp.CSS(`#reasons`)),
		textOf(&reasons, `#reasons`),
	)
	if strings.Contains(reasons, "permanent_error") || !strings.Contains(reasons, "idempotency_key_required") {
		t.Fatalf("reasons after the replay: %q", reasons)
	}

	// Look its key up: completed, with its stored response.
	var keyState, response string
	run(t, ctx, "look the key up",
		chromedp.Navigate(base+"/keys"),
		chromedp.WaitVisible(chromedp.CSS(`#lookup`)),
		chromedp.SendKeys(chromedp.CSS(`input[name=consumer]`), consumerName),
		chromedp.SendKeys(chromedp.CSS(`input[name=key]`), key),
		chromedp.Click(chromedp.CSS(`#lookup`)),
		chromedp.WaitVisible(chromedp.CSS(`#state`)),
		textOf(&keyState, `#state`),
		textOf(&response, `#response`),
	)
	if !strings.Contains(keyState, "completed") || !strings.Contains(response, `"status":"charged"`) {
		t.Fatalf("key state %q, response %q", keyState, response)
	}
	shot(t, ctx, shots, "ui-key.png")

	// The outbox page, with a parked row waiting for an operator.
	parkRow(t, e)
	run(t, ctx, "open the outbox",
		chromedp.Navigate(base+"/outbox"),
		chromedp.WaitVisible(chromedp.CSS(`#parked`)),
	)
	shot(t, ctx, shots, "ui-outbox.png")
}

// parkRow writes an outbox row that was returned unroutable and parked, as
// a relay leaves it.
func parkRow(t *testing.T, e *testenv.Env) {
	t.Helper()
	_, err := e.Pool.Exec(context.Background(), `INSERT INTO `+pgx.Identifier{e.Schema, "outbox"}.Sanitize()+`
(exchange, routing_key, body, message_id, attempts, returns, last_error, parked_at, parked_reason)
VALUES ('ledger', 'entry.eur', '{}', 'order-2026-0998', 5, 5, 'unroutable: 312 NO_ROUTE', now(), 'unroutable: 312 NO_ROUTE (returned 5 times)')`)
	if err != nil {
		t.Fatal(err)
	}
}

var serving = regexp.MustCompile(`idemq ui: serving (http://\S+)/`)

// startUI runs `idemq ui` on the test's schema and queue until the test
// ends, and returns its base URL.
func startUI(t *testing.T, schema string, cfg consumer.Config) string {
	t.Helper()
	cmd := exec.Command(binary, "ui", "--listen", "127.0.0.1:0",
		"--queue", cfg.Queue+"="+consumerName,
		"--max-attempts", fmt.Sprint(cfg.MaxAttempts), "--retry-initial", cfg.RetryInitial.String(),
		"--retry-multiplier", fmt.Sprint(cfg.RetryMultiplier), "--jaeger-url", "http://127.0.0.1:16686")
	cmd.Env = append(os.Environ(), "IDEMQ_POSTGRES_URL="+testdb.URL(), "IDEMQ_AMQP_URL="+testamqp.URL(), "IDEMQ_SCHEMA="+schema)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var logs strings.Builder
	var mu sync.Mutex
	cmd.Stderr = writerFunc(func(p []byte) (int, error) { mu.Lock(); defer mu.Unlock(); return logs.Write(p) })
	if err := cmd.Start(); err != nil {
		t.Fatalf("start idemq ui: %v", err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			mu.Lock()
			t.Logf("idemq ui logs:\n%s", logs.String())
			mu.Unlock()
		}
	})
	found := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if m := serving.FindStringSubmatch(sc.Text()); m != nil {
				found <- m[1]
			}
		}
		_, _ = io.Copy(io.Discard, stdout)
	}()
	select {
	case u := <-found:
		return u
	case <-done:
		t.Fatalf("idemq ui exited before serving:\n%s", logs.String())
	case <-time.After(30 * time.Second):
		t.Fatal("idemq ui did not start serving within 30s")
	}
	return ""
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// browser starts headless Chromium for the test and returns its tab's context.
func browser(t *testing.T) context.Context {
	t.Helper()
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(chromium),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.Flag("disable-extensions", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("force-color-profile", "srgb"),
		chromedp.WindowSize(1280, 860),
		chromedp.UserDataDir(t.TempDir()),
	}
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelTab := chromedp.NewContext(actx, chromedp.WithLogf(t.Logf))
	t.Cleanup(func() { cancelTab(); cancelAlloc() })
	// Start the browser now, so that one that cannot start says so. (Not
	// with a timeout: the first call's context bounds the browser's life.)
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("start %s: %v", chromium, err)
	}
	return ctx
}

// run runs actions in the browser, bounded, failing the test with what.
func run(t *testing.T, ctx context.Context, what string, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := chromedp.Do(ctx, steps...); err != nil {
		loc, _ := chromedp.Run(ctx, chromedp.Location())
		t.Fatalf("%s (at %s): %v", what, loc, err)
	}
}

// textOf stores the visible text of the element sel selects in dst.
func textOf(dst *string, sel string) chromedp.Action[chromedp.Void] {
	return chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
		v, err := chromedp.Text(chromedp.CSS(sel))(ctx, tg)
		*dst = v
		return err
	})
}

// waitFor evaluates cond in the page until it is true; the page may reload
// meanwhile (the replay's progress page refreshes itself).
func waitFor(t *testing.T, ctx context.Context, what, cond string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ectx, cancel := context.WithTimeout(ctx, 5*time.Second)
		ok, err := chromedp.Run(ectx, chromedp.Evaluate[bool](cond))
		cancel()
		if err == nil && ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waiting for %s: %v", what, err)
		}
		<-time.After(100 * time.Millisecond) // poll interval
	}
}

// screenshotDir is where the screenshots go: IDEMQ_UI_SCREENSHOTS (make
// screenshots sets docs/img), else a directory of the test's own, so that a
// test run leaves the tree as it was.
func screenshotDir(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("IDEMQ_UI_SCREENSHOTS")
	if dir == "" {
		return t.TempDir()
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// shot saves a screenshot of the whole page as dir/name (PNG).
func shot(t *testing.T, ctx context.Context, dir, name string) {
	t.Helper()
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	png, err := chromedp.Run(sctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatalf("screenshot %s: %v", name, err)
	}
	if err := os.WriteFile(filepath.Join(dir, name), png, 0o644); err != nil {
		t.Fatal(err)
	}
}
