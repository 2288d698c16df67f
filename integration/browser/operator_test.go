package browser_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testenv"
)

// An operator is told where to look: a queue whose messages no one takes is
// flagged, first, and the flag clears once a worker runs; a reused key's
// letter is not offered for a replay of its reason, and a replay of it
// asked for anyway leaves it where it is unless its box is ticked; the
// replay is in the audit.
func TestOperatorIsToldWhereToLook(t *testing.T) {
	e := testenv.New(t)
	cfg, events := e.ConsumerConfig("idemq-browser-health", consumerName)
	base := startUI(t, e.Schema, cfg)
	ctx := browser(t)
	shots := screenshotDir(t)

	// A payment waits in the queue, and no worker runs.
	e.Publish(cfg.Queue, "order-2026-2001", `{"amount":1200,"currency":"EUR"}`, nil)
	var flags string
	untilOnPage(t, ctx, "the no-consumer flag", base+"/", `!!document.querySelector('#health.critical li.flag[data-check="no_consumer"]')`)
	run(t, ctx, "read the flags", textOf(&flags, `#health`))
	if !strings.Contains(flags, "Look here first.") || !strings.Contains(flags, cfg.Queue+" has 1 message(s) ready and no consumer") {
		t.Fatalf("flags %q", flags)
	}
	shot(t, ctx, shots, "ui-health.png")

	// A worker starts: it handles the payment, and the flag clears. Then
	// the same key comes with another body: a reused key, dead-lettered.
	e.Run(cfg, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		return consumer.Response{Code: 200, Body: []byte(`{"status":"charged"}`)}, nil
	})
	testenv.WaitOutcome(t, events, consumer.OutcomeProcessed)
	e.Publish(cfg.Queue, "order-2026-2001", `{"amount":9900,"currency":"EUR"}`, nil)
	testenv.WaitOutcome(t, events, consumer.OutcomeKeyReuse)
	untilOnPage(t, ctx, "the no-consumer flag to clear", base+"/",
		`!!document.querySelector('#health') && !document.querySelector('li.flag[data-check="no_consumer"]') && !!document.querySelector('li.flag[data-check="dlq_grew"]')`)

	// Not offered for "Replay all"; asked for anyway, refused unless ticked.
	var reasons string
	run(t, ctx, "open the dead letters",
		chromedp.Navigate(base+"/dlq?queue="+cfg.Queue),
		chromedp.WaitVisible(chromedp.CSS(`#reasons`)),
		textOf(&reasons, `#reasons`),
	)
	if !strings.Contains(reasons, "Not offered: its key was first used for another operation") || strings.Contains(reasons, "Replay all") {
		t.Fatalf("reasons %q", reasons)
	}
	run(t, ctx, "ask to replay them anyway",
		chromedp.Click(chromedp.CSS(`button.replay-doomed`)),
		chromedp.WaitVisible(chromedp.CSS(`#doomed`)),
	)
	shot(t, ctx, shots, "ui-replay-refused.png")
	run(t, ctx, "confirm without ticking", chromedp.Click(chromedp.CSS(`#confirm-replay`)))
	waitFor(t, ctx, "the replay to end", `document.querySelector('#job-state') && document.querySelector('#job-state').dataset.done === 'true'`)
	var left string
	run(t, ctx, "read what was left", textOf(&left, `#doomed-left`))
	if !strings.Contains(left, "1 left in the DLQ: their reason cannot succeed unchanged") {
		t.Fatalf("job page %q", left)
	}

	// The audit says who asked, and what moved.
	var entries string
	run(t, ctx, "open the audit",
		chromedp.Navigate(base+"/audit"),
		chromedp.WaitVisible(chromedp.CSS(`#audit tr[data-action="dlq.replay"]`)),
		textOf(&entries, `#audit`),
	)
	if !strings.Contains(entries, "anonymous@127.0.0.1") || !strings.Contains(entries, "reason idempotency_key_reuse") {
		t.Fatalf("audit %q", entries)
	}
	shot(t, ctx, shots, "ui-audit.png")
}

// untilOnPage opens url until cond holds in it, for at most 30 seconds.
func untilOnPage(t *testing.T, ctx context.Context, what, url, cond string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ectx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := chromedp.Do(ectx, chromedp.Navigate(url))
		ok := false
		if err == nil {
			ok, err = chromedp.Run(ectx, chromedp.Evaluate[bool](cond))
		}
		cancel()
		if err == nil && ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waiting for %s at %s: %v", what, url, err)
		}
		<-time.After(200 * time.Millisecond) // poll interval: the page shows a state, it sends no event
	}
}
