//go:build !chaos

package chaos

import (
	"testing"
	"time"
)

// TestSoakShort is the soak in brief, part of every go test ./...: a few
// thousand messages through three worker processes while every kind of
// fault is injected at least once. The long soak is TestSoak (build tag
// chaos, make chaos).
func TestSoakShort(t *testing.T) {
	runSoak(t, soakOptions{
		Messages:     intEnv(t, "IDEMQ_CHAOS_MESSAGES", 3000),
		Workers:      3,
		Concurrency:  4,
		Seed:         uint64(intEnv(t, "IDEMQ_CHAOS_SEED", 0)),
		PublishRate:  35,
		FaultGap:     [2]time.Duration{time.Second, 3 * time.Second},
		EveryKind:    true,
		Timeout:      8 * time.Minute,
		StallTimeout: 2 * time.Minute,
		LeaseMS:      4000,
	})
}

// TestSoakOrderedShort is the ordered soak in brief (ordered_test.go), part
// of every go test ./...: 24 entities × 25 events over 4 partitions while
// the active consumer of a partition is killed and every other kind of
// fault but the queue deletions is injected once. The long one is
// TestSoakOrdered (make chaos).
func TestSoakOrderedShort(t *testing.T) {
	runSoak(t, soakOptions{
		Ordered:      &orderedShape{Keys: 24, Events: 25, Partitions: 4},
		Workers:      3,
		Concurrency:  4,
		Seed:         uint64(intEnv(t, "IDEMQ_CHAOS_SEED", 0)),
		PublishRate:  12,
		FaultGap:     [2]time.Duration{time.Second, 3 * time.Second},
		EveryKind:    true,
		Kinds:        orderedFaultKinds,
		Timeout:      8 * time.Minute,
		StallTimeout: 2 * time.Minute,
		LeaseMS:      4000,
	})
}

// TestSoakShortThroughPgBouncer is the short soak through PgBouncer in
// transaction pooling mode, part of every go test ./...: the workers reach
// Postgres through toxiproxy and a PgBouncer the soak runs itself
// (pgbouncer_test.go), their relays LISTEN on a direct connection, and
// every fault kind that touches the way to Postgres is injected once,
// PgBouncer's own restart and Postgres's included (pgBouncerFaultKinds),
// the network toxics on the link through PgBouncer only.
func TestSoakShortThroughPgBouncer(t *testing.T) {
	runSoak(t, soakOptions{
		Messages:    intEnv(t, "IDEMQ_CHAOS_PGBOUNCER_MESSAGES", 1500),
		Workers:     3,
		Concurrency: 4,
		Seed:        uint64(intEnv(t, "IDEMQ_CHAOS_SEED", 0)),
		// Slow enough that the publishing lasts as long as the nine
		// faults (about a minute): each one meets work.
		PublishRate:  25,
		FaultGap:     [2]time.Duration{time.Second, 3 * time.Second},
		EveryKind:    true,
		Kinds:        pgBouncerFaultKinds,
		NetProxies:   []string{proxyPostgres},
		PgBouncer:    true,
		Timeout:      8 * time.Minute,
		StallTimeout: 2 * time.Minute,
		LeaseMS:      4000,
	})
}
