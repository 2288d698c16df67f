package outbox

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// A waker sends one NOTIFY at a time, folds the requests made during one
// into exactly one more, and always sends one after the last request.
func TestWakerCoalesces(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	started := make(chan struct{}, 100)
	var sent, inFlight, overlapped atomic.Int32
	w := &waker{notify: func(context.Context) error {
		if inFlight.Add(1) > 1 {
			overlapped.Add(1)
		}
		defer inFlight.Add(-1)
		started <- struct{}{}
		<-release
		sent.Add(1)
		return nil
	}}
	w.wake()
	waitChan(t, started, "the first NOTIFY")
	// 100 requests while the first is in flight: one more NOTIFY for all.
	var wg sync.WaitGroup
	for range 100 {
		wg.Go(w.wake)
	}
	wg.Wait()
	release <- struct{}{}
	waitChan(t, started, "the follow-up NOTIFY")
	release <- struct{}{}
	waitIdle(t, w)
	if n := sent.Load(); n != 2 {
		t.Fatalf("%d NOTIFYs for a request and 100 during it, want 2", n)
	}
	if overlapped.Load() != 0 {
		t.Fatal("two NOTIFYs in flight at once")
	}
	// Idle again: the next request sends at once.
	w.wake()
	waitChan(t, started, "a NOTIFY after the waker went idle")
	release <- struct{}{}
	waitIdle(t, w)
	if n := sent.Load(); n != 3 {
		t.Fatalf("%d NOTIFYs, want 3", n)
	}
}

// Whatever the interleaving, every request is followed by a NOTIFY that
// started after it, and no two are in flight at once.
func TestWakerLosesNoRequest(t *testing.T) {
	t.Parallel()
	var (
		requests, lastSeen, sent atomic.Int64
		inFlight, overlapped     atomic.Int32
	)
	w := &waker{notify: func(context.Context) error {
		if inFlight.Add(1) > 1 {
			overlapped.Add(1)
		}
		lastSeen.Store(requests.Load())   // the requests this NOTIFY covers
		time.Sleep(50 * time.Microsecond) // a round trip, not a synchronisation
		sent.Add(1)
		inFlight.Add(-1)
		return nil
	}}
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			for range 500 {
				requests.Add(1)
				w.wake()
			}
		})
	}
	wg.Wait()
	waitIdle(t, w)
	if got, want := lastSeen.Load(), requests.Load(); got != want {
		t.Fatalf("the last NOTIFY started after request %d of %d: a request was lost", got, want)
	}
	if overlapped.Load() != 0 {
		t.Fatal("two NOTIFYs in flight at once")
	}
	t.Logf("%d requests, %d NOTIFYs", requests.Load(), sent.Load())
	if sent.Load() >= requests.Load() {
		t.Fatalf("%d NOTIFYs for %d requests: nothing coalesced", sent.Load(), requests.Load())
	}
}

func waitChan(t *testing.T, c <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-c:
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
}

// waitIdle waits until w has no NOTIFY in flight or asked for.
func waitIdle(t *testing.T, w *waker) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		w.mu.Lock()
		idle := !w.running && !w.again
		w.mu.Unlock()
		if idle {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the waker is still busy after 10s")
		}
		time.Sleep(time.Millisecond)
	}
}
