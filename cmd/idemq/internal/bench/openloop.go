package bench

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// openLoopResult is what an open-loop run measured.
type openLoopResult struct {
	Sent int
	// Failed counts the requests without a 2xx answer (errors included).
	Failed int
	// P50 and P99 of the latencies after the warm-up, from each request's
	// scheduled send time to the end of its answer.
	P50, P99 time.Duration
}

// openLoop sends POSTs of body to url at a fixed rate for d, each with a
// new Idempotency-Key (prefix and a counter), whatever became of the
// earlier ones: unlike wrk, whose connections wait for their answers
// before sending again, it does not slow down when the server does. Each
// latency runs from the request's scheduled send time, not from when it
// went out, so that a request held up behind slow ones (by the scheduler
// falling behind, or a connection still busy) counts its wait: coordinated
// omission does not hide the queueing. The first tenth of the requests is
// a warm-up (connections being opened) and left out of the percentiles.
func openLoop(ctx context.Context, url string, rate float64, d time.Duration, body []byte, prefix string) openLoopResult {
	tr := &http.Transport{MaxIdleConns: 1024, MaxIdleConnsPerHost: 1024, IdleConnTimeout: time.Minute}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	n := max(1, int(rate*d.Seconds()))
	interval := time.Duration(float64(time.Second) / rate)
	lat := make([]int64, n)
	ok := make([]bool, n)
	var wg sync.WaitGroup
	timer := time.NewTimer(0)
	defer timer.Stop()
	start := time.Now()
	sent := 0
	for i := range n {
		at := start.Add(time.Duration(i) * interval)
		if wait := time.Until(at); wait > 0 {
			timer.Reset(wait)
			select {
			case <-ctx.Done():
			case <-timer.C:
			}
		}
		if ctx.Err() != nil {
			break
		}
		sent++
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
			if err != nil {
				return
			}
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Idempotency-Key", prefix+strconv.Itoa(i))
			resp, err := client.Do(req)
			if err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
				ok[i] = resp.StatusCode >= 200 && resp.StatusCode < 300
			}
			lat[i] = int64(time.Since(at))
		}()
	}
	wg.Wait()
	r := openLoopResult{Sent: sent}
	for i := range sent {
		if !ok[i] {
			r.Failed++
		}
	}
	measured := lat[min(sent, sent/10):sent]
	r.P50, r.P99 = percentile(measured, 0.5), percentile(measured, 0.99)
	return r
}
