//go:build cluster

package chaos

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

// TestSoakCluster is the soak on the production topology (make cluster):
// the soak's plan and workers against a three-node RabbitMQ cluster and
// three Postgres members under Patroni in synchronous mode, while the node
// that leads the work queue is stopped (stop_app, then its VM killed) and
// brought back later, then another one, the Patroni leader's postmaster is
// killed (SIGKILL) and Patroni promotes the synchronous standby and brings
// the old leader back as a replica, and a planned switchover moves the
// leader, twice each. The workers know every broker address and the three
// Postgres servers; nothing may be lost or doubled. IDEMQ_CHAOS_MESSAGES
// changes the size (default 6,000: at 25 a second, work enough for the ten
// fault steps of two rounds to meet it), IDEMQ_CHAOS_SEED replays a run.
func TestSoakCluster(t *testing.T) {
	runSoak(t, soakOptions{
		Messages:     intEnv(t, "IDEMQ_CHAOS_MESSAGES", 6000),
		Workers:      3,
		Concurrency:  4,
		Seed:         uint64(intEnv(t, "IDEMQ_CHAOS_SEED", 0)),
		PublishRate:  float64(intEnv(t, "IDEMQ_CHAOS_PUBLISH_RATE", 25)),
		FaultGap:     [2]time.Duration{8 * time.Second, 15 * time.Second},
		EveryKind:    true,
		Rounds:       2,
		Kinds:        clusterFaultKinds,
		Timeout:      14 * time.Minute,
		StallTimeout: 3 * time.Minute,
		LeaseMS:      5000,
		Cluster:      true,
	})
}

// TestSoakOrderedCluster is the ordered soak (ordered_test.go) on the
// production topology: 60 entities × 60 events over 4 partitions (work for
// about four minutes, so that the twelve fault steps meet it) while the
// node leading partition 0 is lost and brought back, the Patroni leader is
// killed and a switchover made, and the active worker of a partition is
// killed, twice each; per entity every event takes effect once, in order.
func TestSoakOrderedCluster(t *testing.T) {
	runSoak(t, soakOptions{
		Ordered:      &orderedShape{Keys: intEnv(t, "IDEMQ_CHAOS_ORDERED_KEYS", 60), Events: intEnv(t, "IDEMQ_CHAOS_ORDERED_EVENTS", 60), Partitions: 4},
		Workers:      3,
		Concurrency:  4,
		Seed:         uint64(intEnv(t, "IDEMQ_CHAOS_SEED", 0)),
		PublishRate:  float64(intEnv(t, "IDEMQ_CHAOS_PUBLISH_RATE", 25)),
		FaultGap:     [2]time.Duration{8 * time.Second, 15 * time.Second},
		EveryKind:    true,
		Rounds:       2,
		Kinds:        append([]string{faultActiveKill}, clusterFaultKinds...),
		Timeout:      12 * time.Minute,
		StallTimeout: 3 * time.Minute,
		LeaseMS:      5000,
		Cluster:      true,
	})
}

// TestClusterUp creates the cluster topology and leaves it running (make
// cluster-up), to point idemq at by hand; TestClusterDown removes it.
func TestClusterUp(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	lockServices(t, "cluster")
	c := newCluster()
	if err := c.teardown(ctx); err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(c.upRabbit(ctx), c.pg.up(ctx)); err != nil {
		t.Fatal(err)
	}
	fmt.Printf("IDEMQ_AMQP_URL=%s\nIDEMQ_POSTGRES_URL=%s\n", strings.Join(c.amqpURLs(), ","), c.pgURL())
}

// TestClusterDown removes what a cluster soak left (make cluster runs it
// after the soak, whatever became of it): the three RabbitMQ nodes and
// their data, Patroni, its Postgres servers and etcd with their directory.
// A no-op when nothing is left.
func TestClusterDown(t *testing.T) {
	lockServices(t, "cluster")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := newCluster().teardown(ctx); err != nil {
		t.Fatal(err)
	}
}
