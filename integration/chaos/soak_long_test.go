//go:build chaos

package chaos

import (
	"flag"
	"testing"
	"time"
)

var (
	messagesFlag = flag.Int("chaos.messages", 0, "messages the soak publishes (default 50000, or IDEMQ_CHAOS_MESSAGES)")
	workersFlag  = flag.Int("chaos.workers", 0, "worker processes (default 4, or IDEMQ_CHAOS_WORKERS)")
)

// TestSoak is the long soak (make chaos): 50,000 messages by default
// through four worker processes while faults of every kind are injected at
// random intervals until every message has settled. Change the size with
// -chaos.messages or IDEMQ_CHAOS_MESSAGES. The publisher is paced
// (IDEMQ_CHAOS_PUBLISH_RATE messages a second, default 70; 0 for no limit)
// so that the faults hit a busy system for most of the run.
func TestSoak(t *testing.T) {
	messages := *messagesFlag
	if messages == 0 {
		messages = intEnv(t, "IDEMQ_CHAOS_MESSAGES", 50000)
	}
	workers := *workersFlag
	if workers == 0 {
		workers = intEnv(t, "IDEMQ_CHAOS_WORKERS", 4)
	}
	runSoak(t, soakOptions{
		Messages:     messages,
		Workers:      workers,
		Concurrency:  8,
		Seed:         uint64(intEnv(t, "IDEMQ_CHAOS_SEED", 0)),
		PublishRate:  float64(intEnv(t, "IDEMQ_CHAOS_PUBLISH_RATE", 70)),
		FaultGap:     [2]time.Duration{5 * time.Second, 20 * time.Second},
		EveryKind:    true,
		Timeout:      55 * time.Minute,
		StallTimeout: 4 * time.Minute,
		LeaseMS:      5000,
	})
}

// TestSoakOrdered is the long ordered soak (make chaos, ordered_test.go):
// 200 entities × 50 events over 4 partitions, through four workers, while
// the active consumer of a partition is killed, the broker and Postgres
// are restarted and the network fails, at random intervals until every
// event took effect. IDEMQ_CHAOS_ORDERED_KEYS and IDEMQ_CHAOS_ORDERED_EVENTS
// change the size.
func TestSoakOrdered(t *testing.T) {
	runSoak(t, soakOptions{
		Ordered: &orderedShape{
			Keys:       intEnv(t, "IDEMQ_CHAOS_ORDERED_KEYS", 200),
			Events:     intEnv(t, "IDEMQ_CHAOS_ORDERED_EVENTS", 50),
			Partitions: 4,
		},
		Workers:      4,
		Concurrency:  8,
		Seed:         uint64(intEnv(t, "IDEMQ_CHAOS_SEED", 0)),
		PublishRate:  float64(intEnv(t, "IDEMQ_CHAOS_PUBLISH_RATE", 40)),
		FaultGap:     [2]time.Duration{5 * time.Second, 15 * time.Second},
		EveryKind:    true,
		Rounds:       2,
		Kinds:        orderedFaultKinds,
		Timeout:      30 * time.Minute,
		StallTimeout: 4 * time.Minute,
		LeaseMS:      5000,
	})
}
