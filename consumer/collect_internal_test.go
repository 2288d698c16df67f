package consumer

import (
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// runCollect starts the collector of a consumer with the given group size
// and partial limit; it returns the channel deliveries go into, the groups
// it hands over and the executors' counter.
func runCollect(t *testing.T, size, partialLimit int) (chan<- amqp.Delivery, <-chan []*amqp.Delivery, *executing) {
	t.Helper()
	c := &Consumer{cfg: Config{Group: Group{Size: size}}, partialLimit: partialLimit}
	in := make(chan amqp.Delivery, 1024)
	out := make(chan []*amqp.Delivery)
	stop := make(chan struct{})
	ex := newExecuting()
	go c.collect(stop, in, out, ex)
	t.Cleanup(func() { close(stop) })
	return in, out, ex
}

func nextGroup(t *testing.T, out <-chan []*amqp.Delivery) []*amqp.Delivery {
	t.Helper()
	select {
	case g := <-out:
		return g
	case <-time.After(5 * time.Second):
		t.Fatal("no group handed over within 5s")
		return nil
	}
}

// A batch handler's group that is not full waits while partialLimit
// groups execute, and goes when one of them finishes; a full group goes at
// once whatever executes.
func TestCollectPartialGroupWaitsForAnExecutingGroup(t *testing.T) {
	in, out, ex := runCollect(t, 10, 2)

	in <- amqp.Delivery{DeliveryTag: 1}
	if g := nextGroup(t, out); len(g) != 1 {
		t.Fatalf("first group: %d deliveries, want 1 (nothing executes: it goes at once)", len(g))
	}
	in <- amqp.Delivery{DeliveryTag: 2}
	if g := nextGroup(t, out); len(g) != 1 {
		t.Fatalf("second group: %d deliveries, want 1 (one executes, below the limit of 2)", len(g))
	}
	// Two execute: the next partial group waits and fills.
	for tag := uint64(3); tag <= 7; tag++ {
		in <- amqp.Delivery{DeliveryTag: tag}
	}
	select {
	case g := <-out:
		t.Fatalf("a partial group of %d went while 2 groups executed", len(g))
	case <-time.After(100 * time.Millisecond):
	}
	ex.finished()
	if g := nextGroup(t, out); len(g) != 5 {
		t.Fatalf("group after one finished: %d deliveries, want the 5 that waited", len(g))
	}
	// Two execute again; a full group goes anyway.
	for tag := uint64(8); tag < 18; tag++ {
		in <- amqp.Delivery{DeliveryTag: tag}
	}
	if g := nextGroup(t, out); len(g) != 10 {
		t.Fatalf("full group: %d deliveries, want 10", len(g))
	}
}

// Without a limit (the handler modes), a partial group goes to any free
// executor whatever executes.
func TestCollectWithoutLimitHandsOverAtOnce(t *testing.T) {
	in, out, _ := runCollect(t, 10, 0)
	for tag := uint64(1); tag <= 4; tag++ {
		in <- amqp.Delivery{DeliveryTag: tag}
		if g := nextGroup(t, out); len(g) != 1 {
			t.Fatalf("group %d: %d deliveries, want 1", tag, len(g))
		}
	}
}
