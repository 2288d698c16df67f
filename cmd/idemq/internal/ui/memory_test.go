package ui_test

import (
	"bytes"
	"fmt"
	"net/url"
	"runtime"
	"testing"
	"time"

	"github.com/idemq/idemq/cmd/idemq/internal/ui"
)

// TestPagesHoldNoBodies fills a DLQ with letters of a few MiB each, then
// renders the overview and the DLQ's list, and samples the live heap (after a
// full collection) while they run: it must stay under the bound the Server
// documents, one letter's size plus LetterLimit × (headers + BodyLimit), and
// far under what holding every body takes. Not parallel: it measures the
// whole process's heap, so it runs while the package's parallel tests wait.
func TestPagesHoldNoBodies(t *testing.T) {
	const (
		letters     = 40
		size        = 4 << 20
		letterLimit = 50
		bodyLimit   = ui.DefaultBodyLimit
	)
	e := newEnv(t, func(c *ui.Config) { c.LetterLimit, c.BodyLimit = letterLimit, bodyLimit })
	body := bytes.Repeat([]byte("b"), size)
	for i := range letters {
		e.deadLetter(fmt.Sprintf("big-%d", i), "permanent_error", "too big", body)
	}
	e.waitReady(e.topo.DLQ, letters)
	body = nil

	// The bound, with room for what the broker's client buffers (one body
	// being read and the last one read, which the channel keeps until the
	// next) and for the rest of the process (the HTTP client and server,
	// the pool, the test's own garbage).
	const headers = 16 << 10
	bound := uint64(2*size + letterLimit*(headers+bodyLimit) + 16<<20)

	for _, path := range []string{"/", "/dlq?queue=" + url.QueryEscape(e.topo.Queue), "/"} {
		base := liveHeap()
		peak := watchHeap(t)
		p := e.get(path)
		grew := peak() - min(peak(), base)
		t.Logf("%s: live heap grew by %.1f MiB at most (bound %.1f MiB; all bodies %.1f MiB)", path, mib(grew), mib(bound), mib(letters*size))
		mustContain(t, p, "permanent_error")
		if grew > bound {
			t.Errorf("%s: the live heap grew by %.1f MiB, more than the bound of %.1f MiB", path, mib(grew), mib(bound))
		}
	}
	e.waitReady(e.topo.DLQ, letters)
}

// liveHeap is the live heap after a full collection.
func liveHeap() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// watchHeap samples the live heap until the returned function is first
// called, which stops the sampling (after one last sample) and returns the
// highest seen.
func watchHeap(t *testing.T) func() uint64 {
	stop, done := make(chan struct{}), make(chan uint64, 1)
	go func() {
		var most uint64
		for {
			most = max(most, liveHeap())
			select {
			case <-stop:
				done <- most
				return
			case <-time.After(2 * time.Millisecond): // sampling interval
			}
		}
	}()
	var peak uint64
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			close(stop)
			<-done
		}
	})
	return func() uint64 {
		if !stopped {
			stopped = true
			close(stop)
			peak = <-done
		}
		return peak
	}
}

func mib(n uint64) float64 { return float64(n) / (1 << 20) }
