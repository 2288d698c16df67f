package browser_test

import (
	"context"
	"net/url"
	"strings"
	"testing"

	"github.com/chromedp/chromedp"

	"github.com/idemq/idemq/internal/testenv"
)

// rebound is the attacker's name that the browser resolves to 127.0.0.1, as
// a DNS rebinding attack makes it do.
const rebound = "rebind.attacker.example"

// A page whose name an attacker rebinds to 127.0.0.1 is same-origin with
// the UI in the browser; the UI answers it 421 and nothing else, while the
// names it is opened at work.
func TestReboundPageGetsNothing(t *testing.T) {
	e := testenv.New(t)
	cfg, _ := e.ConsumerConfig("idemq-browser-rebind", consumerName)
	base := startUI(t, e.Schema, cfg)
	u, err := url.Parse(base)
	if err != nil {
		t.Fatal(err)
	}
	ctx := resolvingBrowser(t, "MAP "+rebound+" 127.0.0.1")

	for _, origin := range []string{base, "http://localhost:" + u.Port()} {
		var text string
		run(t, ctx, "open the overview at "+origin,
			chromedp.Navigate(origin+"/"),
			chromedp.WaitVisible(chromedp.CSS(`h1`)),
			textOf(&text, `h1`),
		)
		if !strings.Contains(text, "Overview") {
			t.Fatalf("%s/: heading %q", origin, text)
		}
	}
	for _, path := range []string{"/", "/dlq?queue=" + url.QueryEscape(cfg.Queue), "/login", "/static/style.css"} {
		var text string
		run(t, ctx, "open "+path+" at the rebound name",
			chromedp.Navigate("http://"+rebound+":"+u.Port()+path),
			chromedp.WaitReady(chromedp.CSS(`body`)),
			textOf(&text, `body`),
		)
		if !strings.Contains(text, "421 misdirected request") || strings.Contains(text, cfg.Queue) || strings.Contains(text, "Overview") {
			t.Fatalf("http://%s:%s%s shows %q; want the UI's 421 and nothing of its pages", rebound, u.Port(), path, text)
		}
	}
}

// resolvingBrowser is browser with Chromium's host resolver rules set to
// rules (--host-resolver-rules), and HTTPS upgrades off so that the
// rebound name is fetched over HTTP as typed.
func resolvingBrowser(t *testing.T, rules string) context.Context {
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
		chromedp.Flag("host-resolver-rules", rules),
		chromedp.Flag("disable-features", "HttpsUpgrades"),
		chromedp.UserDataDir(t.TempDir()),
	}
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelTab := chromedp.NewContext(actx, chromedp.WithLogf(t.Logf))
	t.Cleanup(func() { cancelTab(); cancelAlloc() })
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("start %s: %v", chromium, err)
	}
	return ctx
}
