package dedup_test

import (
	"context"
	"testing"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/keystore"
)

// ReleaseBatch gives up many keys with one statement: each released key is
// taken over at once by the next reservation, and a lease already lost is
// reported and left alone.
func TestReleaseBatch(t *testing.T) {
	t.Parallel()
	for _, durable := range []bool{false, true} {
		t.Run(map[bool]string{false: "async", true: "durable"}[durable], func(t *testing.T) {
			t.Parallel()
			store, _ := newStore(t, 4, &dedup.Config{DurableReservations: durable})
			ctx := context.Background()
			a := mustReserve(t, store, claim("rel-a", "b"), dedup.Acquired).Lease
			b := mustReserve(t, store, claim("rel-b", "b"), dedup.Acquired).Lease
			held := mustReserve(t, store, claim("rel-c", "b"), dedup.Acquired).Lease
			stale := *held
			stale.Token = [16]byte{1}

			lost, err := keystore.Of(store).ReleaseBatch(ctx, []*dedup.Lease{b, &stale, a}, []string{"retried", "retried", "retried"})
			if err != nil {
				t.Fatal(err)
			}
			if len(lost) != 1 || lost[0] != &stale {
				t.Fatalf("lost %v, want only the stale lease", lost)
			}
			for _, key := range []string{"rel-a", "rel-b"} {
				r := mustReserve(t, store, claim(key, "b"), dedup.Acquired)
				if r.Lease.Attempts != 2 || !r.Lease.TakenOver {
					t.Fatalf("%s after release: %+v, want taken over on the 2nd reservation", key, r.Lease)
				}
			}
			mustReserve(t, store, claim("rel-c", "b"), dedup.Busy)
			if lost, err := keystore.Of(store).ReleaseBatch(ctx, nil, nil); err != nil || lost != nil {
				t.Fatalf("empty release: %v %v", lost, err)
			}
		})
	}
}
