package consumer

import (
	"sync"
	"testing"
	"time"
)

// frameLog records the frames an ackWindow sends, and checks them against
// what a broker would do: a multiple ack settles every outstanding tag up
// to its own, and must never cover one whose outcome is not durable.
type frameLog struct {
	mu       sync.Mutex
	t        *testing.T
	frames   []string
	durable  map[uint64]bool // tags marked ready or nacked by the test
	settled  map[uint64]bool
	tracked  []uint64
	acked    int
	multiple int
}

func newFrameLog(t *testing.T) *frameLog {
	return &frameLog{t: t, durable: map[uint64]bool{}, settled: map[uint64]bool{}}
}

func (f *frameLog) Ack(tag uint64, multiple bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !multiple {
		f.settle(tag)
		return nil
	}
	f.multiple++
	for _, t := range f.tracked {
		if t <= tag && !f.settled[t] {
			f.settle(t)
		}
	}
	return nil
}

func (f *frameLog) Nack(tag uint64, multiple, requeue bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if multiple || !requeue {
		f.t.Errorf("nack(%d, multiple=%v, requeue=%v): want a single requeueing nack", tag, multiple, requeue)
	}
	f.settled[tag] = true
	return nil
}

func (f *frameLog) settle(tag uint64) {
	if !f.durable[tag] {
		f.t.Errorf("tag %d acked before its outcome was durable", tag)
	}
	if f.settled[tag] {
		f.t.Errorf("tag %d settled twice", tag)
	}
	f.settled[tag] = true
	f.acked++
}

func (f *frameLog) markDurable(tag uint64) {
	f.mu.Lock()
	f.durable[tag] = true
	f.mu.Unlock()
}

func (f *frameLog) isSettled(tag uint64) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.settled[tag]
}

// deliveredWindow is a window of the given prefetch over tags 1..n, all
// delivered, and the frame log that checks what it sends.
func deliveredWindow(t *testing.T, prefetch int, n uint64) (*ackWindow, *frameLog) {
	f := newFrameLog(t)
	w := newAckWindow(f, prefetch, nil)
	for tag := uint64(1); tag <= n; tag++ {
		f.tracked = append(f.tracked, tag)
		w.track(tag)
	}
	return w, f
}

// markReady makes tags durable and marks them ready.
func markReady(w *ackWindow, f *frameLog, tags ...uint64) {
	for _, tag := range tags {
		f.markDurable(tag)
		w.ready(tag)
	}
}

// span returns the tags from..to.
func span(from, to uint64) []uint64 {
	var out []uint64
	for tag := from; tag <= to; tag++ {
		out = append(out, tag)
	}
	return out
}

func TestAckWindowCoalescesASettledPrefix(t *testing.T) {
	w, f := deliveredWindow(t, 256, 16)
	markReady(w, f, span(1, 16)...)
	w.flush()
	frames, settled := w.stats()
	if frames != 1 || settled != 16 || f.acked != 16 {
		t.Fatalf("frames %d, settled %d, broker acked %d: want one frame for 16 acks", frames, settled, f.acked)
	}
}

func TestAckWindowHoldsAcksAboveAnUnsettledDelivery(t *testing.T) {
	w, f := deliveredWindow(t, 256, 10)
	// Tag 1 is slow; 2..10 are done.
	markReady(w, f, span(2, 10)...)
	w.flush()
	if f.isSettled(1) {
		t.Fatal("tag 1 settled while still in flight")
	}
	// Held acks go out on their own within ackHoldFor, never covering tag 1.
	deadline := time.Now().Add(2 * time.Second)
	for !f.isSettled(10) {
		if time.Now().After(deadline) {
			t.Fatal("held acks were not sent within 2s")
		}
		time.Sleep(time.Millisecond) // polling a condition, not synchronising on time
	}
	if f.isSettled(1) {
		t.Fatal("tag 1 settled by a held ack")
	}
	markReady(w, f, 1)
	w.flush()
	if !f.isSettled(1) {
		t.Fatal("tag 1 not acked after it became ready")
	}
	if f.acked != 10 {
		t.Fatalf("broker acked %d, want 10", f.acked)
	}
}

func TestAckWindowSendsHeldAcksWhenTooManyWait(t *testing.T) {
	w, f := deliveredWindow(t, 8, 8)
	markReady(w, f, span(2, 6)...)
	w.flush()
	for tag := uint64(2); tag <= 6; tag++ {
		if !f.isSettled(tag) {
			t.Errorf("tag %d held although 5 > 4 acks wait", tag)
		}
	}
	if f.isSettled(1) || f.isSettled(7) {
		t.Fatal("a multiple ack covered an unsettled delivery")
	}
}

func TestAckWindowNackIsNeverCoveredByAMultipleAck(t *testing.T) {
	w, f := deliveredWindow(t, 256, 5)
	if err := w.nack(3); err != nil {
		t.Fatal(err)
	}
	markReady(w, f, 1, 2, 4, 5)
	w.flush()
	// The frame log fails the test if the multiple ack settled tag 3 again.
	if f.acked != 4 || f.multiple != 1 {
		t.Fatalf("broker acked %d with %d multiple acks, want 4 with 1", f.acked, f.multiple)
	}
}

func TestAckWindowFlushAllSendsEveryReadyAck(t *testing.T) {
	w, f := deliveredWindow(t, 256, 6)
	markReady(w, f, 1, 2, 4, 6) // 3 and 5 never ran
	w.flushAll()
	for _, tag := range []uint64{1, 2, 4, 6} {
		if !f.isSettled(tag) {
			t.Errorf("tag %d not acked at the end of the session", tag)
		}
	}
	if f.isSettled(3) || f.isSettled(5) {
		t.Fatal("a delivery that never ran was acked")
	}
}

// A random interleaving of many workers: every ack lands once, none early.
func TestAckWindowConcurrentWorkers(t *testing.T) {
	f := newFrameLog(t)
	w := newAckWindow(f, 64, nil)
	const n = 5000
	tags := make(chan uint64, 64)
	go func() {
		for tag := uint64(1); tag <= n; tag++ {
			f.mu.Lock()
			f.tracked = append(f.tracked, tag)
			f.mu.Unlock()
			w.track(tag)
			tags <- tag
		}
		close(tags)
	}()
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for tag := range tags {
				f.markDurable(tag)
				if tag%97 == 0 {
					_ = w.nack(tag)
				} else {
					w.ready(tag)
				}
				w.flush()
			}
		})
	}
	wg.Wait()
	w.flushAll()
	frames, settled := w.stats()
	f.mu.Lock()
	defer f.mu.Unlock()
	if want := n - n/97; f.acked != want || settled != want {
		t.Fatalf("broker acked %d, window settled %d, want %d", f.acked, settled, want)
	}
	t.Logf("%d acks in %d frames", settled, frames)
}

type discardAcks struct{}

func (discardAcks) Ack(uint64, bool) error        { return nil }
func (discardAcks) Nack(uint64, bool, bool) error { return nil }

// BenchmarkAckWindow settles deliveries as 8 workers of 16-message groups
// do: the cost of tracking, marking and flushing one delivery. (Frames per
// ack here are not the consumer's: nothing bounds the deliveries in flight
// as a prefetch does, so held acks overflow.)
func BenchmarkAckWindow(b *testing.B) {
	w := newAckWindow(discardAcks{}, 256, nil)
	groups := make(chan []uint64, 16)
	go func() {
		defer close(groups)
		tag := uint64(0)
		for n := 0; n < b.N; n += 16 {
			g := make([]uint64, 16)
			for i := range g {
				tag++
				w.track(tag)
				g[i] = tag
			}
			groups <- g
		}
	}()
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for g := range groups {
				for _, tag := range g {
					w.ready(tag)
				}
				w.flush()
			}
		})
	}
	wg.Wait()
	w.flushAll()
}

// A stopped window (its session ended) sends nothing more, not even when
// the hold timer it armed would have fired.
func TestAckWindowSendsNothingAfterStop(t *testing.T) {
	w, f := deliveredWindow(t, 256, 4)
	markReady(w, f, 2, 3, 4) // held above tag 1: the timer is armed
	w.flush()
	w.stop()
	// Nothing to wait for: the absence of frames over three hold periods.
	<-time.After(3 * ackHoldFor)
	w.flushAll()
	if frames, _ := w.stats(); frames != 0 {
		t.Fatalf("%d frames sent after stop, want 0", frames)
	}
}
