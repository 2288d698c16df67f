package consumer

import (
	"testing"
	"time"
)

// TestLogLimiter: at most limit lines per window; the first line of a later
// window reports how many were suppressed since the last one let through.
func TestLogLimiter(t *testing.T) {
	l := logLimiter{limit: 3, window: time.Second}
	t0 := time.Unix(1700000000, 0)
	for i := range 3 {
		if ok, n := l.allow(t0.Add(time.Duration(i) * time.Millisecond)); !ok || n != 0 {
			t.Fatalf("line %d: allow = %v, %d; want true, 0", i, ok, n)
		}
	}
	for i := range 5 {
		if ok, _ := l.allow(t0.Add(500 * time.Millisecond)); ok {
			t.Fatalf("line %d over the limit was let through", 3+i)
		}
	}
	if ok, n := l.allow(t0.Add(time.Second)); !ok || n != 5 {
		t.Fatalf("first line of the next window: allow = %v, %d; want true, 5", ok, n)
	}
	if ok, n := l.allow(t0.Add(time.Second + time.Millisecond)); !ok || n != 0 {
		t.Fatalf("second line of the next window: allow = %v, %d; want true, 0", ok, n)
	}

	var d logLimiter // defaults: 10 a second
	for i := range failureLogsPerSecond {
		if ok, _ := d.allow(t0); !ok {
			t.Fatalf("default limiter refused line %d", i)
		}
	}
	if ok, _ := d.allow(t0); ok {
		t.Fatalf("default limiter let line %d through", failureLogsPerSecond+1)
	}
}
