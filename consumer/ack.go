package consumer

import (
	"slices"
	"sync"
	"time"
)

// acknowledger is the part of an AMQP channel that settles deliveries
// (amqp.Acknowledger without Reject).
type acknowledger interface {
	Ack(tag uint64, multiple bool) error
	Nack(tag uint64, multiple, requeue bool) error
}

// ackState is where one delivered tag stands.
type ackState uint8

const (
	ackPending ackState = iota // being handled, or waiting to be
	ackReady                   // its outcome is durable: may be acked
	ackSent                    // settled on its own (an ack or a nack already sent)
)

// Bounds on acks held back for coalescing.
const (
	// ackHoldFor is how long a ready ack may wait above an unsettled
	// delivery before it is sent on its own.
	ackHoldFor = 20 * time.Millisecond
	// ackHoldShare: at most prefetch/ackHoldShare ready acks wait; more are
	// sent on their own, so held acks never starve the prefetch window.
	ackHoldShare = 2
)

// ackWindow settles one channel's deliveries and coalesces their acks into
// multiple-acks where that is safe.
//
// A multiple ack settles every outstanding delivery up to its tag, so it is
// only safe up to the lowest delivery whose outcome is not yet durable. The
// window tracks every tag the channel delivered, in order, and acks with
// multiple=true up to the end of the settled prefix. A ready ack above an
// unsettled delivery is held until the prefix reaches it, or sent on its own
// when it has waited ackHoldFor or when too many are held: a slow handler
// never holds its successors' acks for long. Nacks are sent at once, on
// their own, and a multiple ack never covers a delivery not marked ready.
//
// Workers mark acks ready as outcomes become durable and call flush after
// each delivery or group, so that one group's acks leave in one frame.
type ackWindow struct {
	ch      acknowledger
	maxHeld int
	onError func(error)

	mu      sync.Mutex
	tags    []uint64 // every tracked tag, ascending, from head on
	state   []ackState
	readyAt []time.Time // when a ready ack began to wait
	head    int
	held    int // ready, not yet sent
	timer   *time.Timer
	failed  bool // an ack failed: the channel is gone, say it once
	stopped bool // the session ended: nothing more is sent
	// stats, for tests and benchmarks
	frames, settled int
}

func newAckWindow(ch acknowledger, prefetch int, onError func(error)) *ackWindow {
	return &ackWindow{ch: ch, maxHeld: max(1, prefetch/ackHoldShare), onError: onError}
}

// track registers a delivered tag; tags arrive in ascending order.
func (w *ackWindow) track(tag uint64) {
	w.mu.Lock()
	w.tags = append(w.tags, tag)
	w.state = append(w.state, ackPending)
	w.readyAt = append(w.readyAt, time.Time{})
	w.mu.Unlock()
}

// ready marks tag's outcome durable: its ack may be sent, alone or as part
// of a multiple ack, from the next flush on.
func (w *ackWindow) ready(tag uint64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if i, ok := w.find(tag); ok && w.state[i] == ackPending {
		w.state[i] = ackReady
		w.readyAt[i] = time.Now()
		w.held++
	}
}

// nack returns tag to the queue at once.
func (w *ackWindow) nack(tag uint64) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	err := w.ch.Nack(tag, false, true)
	if i, ok := w.find(tag); ok {
		if w.state[i] == ackReady {
			w.held--
		}
		w.state[i] = ackSent
	}
	w.frames++
	return err
}

// flush sends one multiple ack for the settled prefix; ready acks above it
// wait (bounded by ackHoldFor and maxHeld).
func (w *ackWindow) flush() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopped {
		return
	}
	w.advance()
	switch {
	case w.held > w.maxHeld:
		w.sendHeld(time.Time{})
	case w.held > 0 && w.timer == nil:
		w.timer = time.AfterFunc(ackHoldFor, w.expire)
	}
}

// flushAll sends every ready ack: the prefix as one multiple ack, the rest
// on their own. Called when the session stops.
func (w *ackWindow) flushAll() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopped {
		return
	}
	w.advance()
	w.sendHeld(time.Time{})
}

// stop ends the window with its session: held acks are dropped (the
// channel is closing; the broker redelivers those messages and their keys
// make that harmless) and the timer no longer fires.
func (w *ackWindow) stop() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.stopped = true
	if w.timer != nil {
		w.timer.Stop()
		w.timer = nil
	}
}

// expire sends the acks that have waited ackHoldFor, and waits again for
// the others.
func (w *ackWindow) expire() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.timer = nil
	if w.stopped {
		return
	}
	w.advance()
	w.sendHeld(time.Now().Add(-ackHoldFor))
	if w.held > 0 {
		w.timer = time.AfterFunc(ackHoldFor/2, w.expire)
	}
}

// advance pops the settled prefix and acks it with one frame.
func (w *ackWindow) advance() {
	var last uint64
	n := 0
	for w.head < len(w.tags) && w.state[w.head] != ackPending {
		if w.state[w.head] == ackReady {
			last = w.tags[w.head]
			n++
		}
		w.head++
	}
	if n > 0 {
		w.send(last, true)
		w.held -= n
		w.settled += n
	}
	// Reclaim the popped prefix once it is the larger part.
	if w.head > 64 && w.head*2 > len(w.tags) {
		w.tags = slices.Delete(w.tags, 0, w.head)
		w.state = slices.Delete(w.state, 0, w.head)
		w.readyAt = slices.Delete(w.readyAt, 0, w.head)
		w.head = 0
	}
}

// sendHeld acks on its own every held ready tag that has waited since
// cutoff (every one for a zero cutoff).
func (w *ackWindow) sendHeld(cutoff time.Time) {
	for i := w.head; i < len(w.tags) && w.held > 0; i++ {
		if w.state[i] == ackReady && (cutoff.IsZero() || !w.readyAt[i].After(cutoff)) {
			w.send(w.tags[i], false)
			w.state[i] = ackSent
			w.held--
			w.settled++
		}
	}
	if w.timer != nil && w.held == 0 {
		w.timer.Stop()
		w.timer = nil
	}
}

func (w *ackWindow) send(tag uint64, multiple bool) {
	w.frames++
	if err := w.ch.Ack(tag, multiple); err != nil && !w.failed {
		w.failed = true
		if w.onError != nil {
			w.onError(err)
		}
	}
}

// find locates tag among the unsettled tags.
func (w *ackWindow) find(tag uint64) (int, bool) {
	i, ok := slices.BinarySearch(w.tags[w.head:], tag)
	return w.head + i, ok
}

// stats reports frames sent and deliveries acked.
func (w *ackWindow) stats() (frames, settled int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.frames, w.settled
}
