package consumer

import "sync"

// byteBudget bounds the body bytes of the deliveries a session holds: taken
// from the client library and not yet settled. One goroutine takes (the
// session's buffering goroutine); workers give back as they settle.
type byteBudget struct {
	max   int64
	mu    sync.Mutex
	used  int64
	freed chan struct{} // a give since the taker last looked
}

func newByteBudget(max int64) *byteBudget {
	return &byteBudget{max: max, freed: make(chan struct{}, 1)}
}

// take waits until n more bytes fit in the budget, or until stop is closed
// (false). With nothing held, anything fits: a delivery larger than the
// whole budget is taken, alone, rather than never.
func (b *byteBudget) take(n int64, stop <-chan struct{}) bool {
	for {
		b.mu.Lock()
		if b.used == 0 || b.used+n <= b.max {
			b.used += n
			b.mu.Unlock()
			return true
		}
		b.mu.Unlock()
		select {
		case <-b.freed:
		case <-stop:
			return false
		}
	}
}

// force takes n bytes whether they fit or not: a delivery held already
// (an ordered one that waited) going back to the pipeline.
func (b *byteBudget) force(n int64) {
	b.mu.Lock()
	b.used += n
	b.mu.Unlock()
}

// give returns n bytes to the budget.
func (b *byteBudget) give(n int64) {
	b.mu.Lock()
	b.used -= n
	b.mu.Unlock()
	select {
	case b.freed <- struct{}{}:
	default:
	}
}
