package consumer_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
)

// Inside one group, a handler that fails and a key whose lease is lost
// while its handler runs roll back only their own effects: the batch-mates
// commit, each exactly once. (Where a group holds its keys in its
// transaction there is no lease to lose, and no key is stolen.)
func TestGroupIsolatesAFailureAndALostLease(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, func(c *consumer.Config) { c.Concurrency = 1 })
		const n = 10
		failing, stolen := keyOf(3, "g"), keyOf(5, "g")
		if !m.Separate() {
			stolen = ""
		}
		for i := range n {
			h.publish(keyOf(i, "g"), `{"n":1}`, nil)
		}
		var steals atomic.Int64
		h.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			switch d.Key {
			case failing:
				if _, err := tx.Exec(ctx, "INSERT INTO "+h.schema+".ledger (key, attempt) VALUES ($1, -1)", d.Key); err != nil {
					return consumer.Response{}, err
				}
				return consumer.Response{}, consumer.Permanent(errors.New("card declined by the test"))
			case stolen:
				if steals.Add(1) == 1 {
					// Another worker takes the key over and completes it while
					// this handler runs (its own connection, its own commit).
					if _, err := h.pool.Exec(ctx, "UPDATE "+h.schema+".keys SET state = 'completed', outcome = 'ok', lease_token = NULL, locked_until = NULL, completed_at = now() WHERE key = $1", d.Key); err != nil {
						return consumer.Response{}, err
					}
				}
			}
			return h.ledgerEffect(ctx, tx, d)
		})
		evs := h.waitEvents(30*time.Second, "every message's outcome", func(evs []consumer.Event) bool { return finals(evs) >= n })
		byKey := map[consumer.Outcome]int{}
		for _, e := range evs {
			byKey[e.Outcome]++
		}
		wantProcessed, wantDuplicates := n-2, 1
		if stolen == "" {
			wantProcessed, wantDuplicates = n-1, 0
		}
		if byKey[consumer.OutcomeProcessed] != wantProcessed || byKey[consumer.OutcomeDeadLettered] != 1 || byKey[consumer.OutcomeDuplicate] != wantDuplicates {
			t.Fatalf("outcomes %v: want %d processed, 1 dead-lettered, %d duplicate (after its lease was lost)", byKey, wantProcessed, wantDuplicates)
		}
		eff := h.effects()
		for i := range n {
			key, want := keyOf(i, "g"), 1
			if key == failing || key == stolen {
				want = 0
			}
			if eff[key] != want {
				t.Errorf("key %s applied %d times, want %d", key, eff[key], want)
			}
		}
	})
}
