package consumer

import (
	"testing"
	"time"
)

func TestByteBudget(t *testing.T) {
	b := newByteBudget(100)
	stop := make(chan struct{})
	if !b.take(60, stop) || !b.take(40, stop) {
		t.Fatal("what fits was refused")
	}
	taken := make(chan bool, 1)
	go func() { taken <- b.take(10, stop) }()
	select {
	case <-taken:
		t.Fatal("took 10 bytes over a full budget")
	case <-time.After(50 * time.Millisecond): // still waiting, as it should
	}
	b.give(60)
	if ok := <-taken; !ok {
		t.Fatal("the wait ended without the bytes")
	}
	b.give(40)
	b.give(10)
	// Nothing held: a delivery larger than the whole budget goes, alone.
	if !b.take(500, stop) {
		t.Fatal("an oversized delivery was refused with nothing held")
	}
	go func() { taken <- b.take(1, stop) }()
	close(stop)
	if ok := <-taken; ok {
		t.Fatal("took bytes over the budget after the stop")
	}
}
