package ui

import (
	"testing"
	"time"
)

// The letters that came into a DLQ are the rises of its depth from one read
// to the next within the window; a drain (a replay) between them takes
// nothing off, and a rise older than the window no longer counts.
func TestArrivalsCountRisesWithinTheWindow(t *testing.T) {
	var a arrivals
	t0 := time.Date(2026, 12, 4, 10, 0, 0, 0, time.UTC)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	if n, _ := a.count("q.dlq", t0); n != 0 {
		t.Fatalf("never read: %d", n)
	}
	a.observe("q.dlq", 5, at(0)) // the first read: what was there before is not counted
	a.observe("q.dlq", 7, at(10*time.Second))
	a.observe("q.dlq", 0, at(2*time.Minute)) // replayed
	a.observe("q.dlq", 3, at(30*time.Minute))
	if n, since := a.count("q.dlq", at(31*time.Minute)); n != 5 || !since.Equal(t0) {
		t.Fatalf("after 31m: %d since %s, want 5 since the first read", n, since)
	}
	// An hour after the first rise's minute, only the second counts.
	if n, since := a.count("q.dlq", at(61*time.Minute)); n != 3 || !since.Equal(at(time.Minute)) {
		t.Fatalf("after 61m: %d since %s, want 3 within the last hour", n, since)
	}
	if n, _ := a.count("q.dlq", at(2*time.Hour)); n != 0 {
		t.Fatalf("after 2h: %d, want 0", n)
	}
	if n, _ := a.count("other.dlq", at(time.Minute)); n != 0 {
		t.Fatalf("another DLQ: %d", n)
	}
}
