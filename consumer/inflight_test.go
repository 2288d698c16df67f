package consumer_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
)

// The runtime holds at most MaxInFlightBytes of bodies: a worker that waits
// (Group.Linger) for a group of 16 gets only the deliveries that fit in the
// budget, however many the prefetch let in; and a message larger than the
// whole budget is still handled, alone.
func TestInFlightBytesBoundGroups(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		const (
			budget = 1 << 20
			small  = 400 << 10 // two fit in the budget, three do not
			big    = 3 << 19   // more than the whole budget
			smalls = 6
		)
		h := newHarness(t, m, func(c *consumer.Config) {
			c.Concurrency, c.Group.Size, c.Group.Linger = 1, 16, 300*time.Millisecond
			c.MaxInFlightBytes = budget
		})
		h.publish("big", strings.Repeat("B", big), nil)
		for i := range smalls {
			h.publish(keyOf(i, "small"), strings.Repeat("s", small), nil)
		}

		var mu sync.Mutex
		var batches [][]int // body sizes of each batch
		ledger := asBatch(h.ledgerEffect)
		c, err := consumer.NewBatch(h.store, func(ctx context.Context, tx pgx.Tx, ds []*consumer.Delivery) ([]consumer.Response, error) {
			sizes := make([]int, len(ds))
			for i, d := range ds {
				sizes[i] = len(d.Body)
			}
			mu.Lock()
			batches = append(batches, sizes)
			mu.Unlock()
			return ledger(ctx, tx, ds)
		}, &h.cfg)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- c.Run(ctx) }()
		t.Cleanup(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("run: %v", err)
			}
		})

		h.waitEvents(60*time.Second, "every message processed", func(evs []consumer.Event) bool {
			return countOutcomes(evs)[consumer.OutcomeProcessed] == smalls+1
		})
		mu.Lock()
		defer mu.Unlock()
		largest := 0
		for _, b := range batches {
			sum := 0
			for _, n := range b {
				sum += n
				if n == big && len(b) > 1 {
					t.Fatalf("the oversized message shared a batch: %v", b)
				}
			}
			if len(b) > 1 && sum > budget {
				t.Fatalf("a batch of %d bodies, %d bytes, over the %d-byte budget (batches %v)", len(b), sum, budget, batches)
			}
			largest = max(largest, len(b))
		}
		if largest != 2 {
			t.Fatalf("largest batch %d, want 2 (what fits in the budget); batches %v", largest, batches)
		}
		if eff := h.effects(); len(eff) != smalls+1 {
			t.Fatalf("effects %v, want one per message", eff)
		}
	})
}
