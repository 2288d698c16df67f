package consumertest

import (
	"testing"
	"time"
)

// pollInterval is how often WaitFor checks its condition.
const pollInterval = 10 * time.Millisecond

// WaitFor checks cond every few milliseconds until it holds, and fails the
// test ("timed out after 30s waiting for <what>") if it still does not
// after timeout. Use it in integration tests to wait for what a running
// consumer does (a row written, an outcome reported) instead of sleeping.
func WaitFor(tb testing.TB, timeout time.Duration, what string, cond func() bool) {
	tb.Helper()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	for !cond() {
		select {
		case <-deadline.C:
			if cond() {
				return
			}
			tb.Fatalf("timed out after %s waiting for %s", timeout, what)
		case <-tick.C:
		}
	}
}
