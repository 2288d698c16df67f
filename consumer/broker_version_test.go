package consumer_test

import (
	"context"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testamqp"
)

// The declarations chosen for a broker's version: RabbitMQ 4 gives quorum
// queues a delivery limit of 20 unless told otherwise, and every read of a
// DLQ (basic.get, given back) counts a delivery; so on 4.x the DLQ and the
// retry tiers lift it (-1), and on 3.x, which has no default limit and
// refuses -1, they are declared as before. The work queue keeps its own
// limit on both; classic queues have none to lift.
func TestDeclarationsForTheBrokerVersion(t *testing.T) {
	t.Parallel()
	base := consumer.NewTopology(consumer.TopologyConfig{Queue: "payments"})
	d := base.Delays[0]
	for _, c := range []struct {
		version string
		lifted  bool
	}{{"", false}, {"3.10.7", false}, {"3.13.7", false}, {"4.0.5", true}, {"4.1.0", true}, {"10.0.0", true}, {"garbage", false}} {
		topo := base.OnBroker(c.version)
		for name, args := range map[string]amqp.Table{"DLQ": topo.DLQArgs(), "tier": topo.TierArgs(d)} {
			limit, has := args["x-delivery-limit"]
			if has != c.lifted || (has && limit != int64(-1)) {
				t.Errorf("%s on %q: x-delivery-limit %v (set %v), want lifted %v", name, c.version, limit, has, c.lifted)
			}
			if args["x-queue-type"] != "quorum" {
				t.Errorf("%s on %q: %v", name, c.version, args)
			}
		}
		if got := topo.WorkQueueArgs()["x-delivery-limit"]; got != int64(consumer.DefaultDeliveryLimit) {
			t.Errorf("work queue on %q: x-delivery-limit %v, want %d", c.version, got, consumer.DefaultDeliveryLimit)
		}
	}
	classic := consumer.NewTopology(consumer.TopologyConfig{Queue: "payments", ClassicQueues: true}).OnBroker("4.0.5")
	if _, has := classic.DLQArgs()["x-delivery-limit"]; has {
		t.Errorf("classic DLQ on 4.x: %v", classic.DLQArgs())
	}
	parted := consumer.NewTopology(consumer.TopologyConfig{Queue: "ledger", Partitions: 2}).OnBroker("4.0.5")
	if parted.Partitions[1].BrokerVersion != "4.0.5" || parted.Partitions[1].DLQArgs()["x-delivery-limit"] != int64(-1) {
		t.Errorf("a partition on 4.x: %+v", parted.Partitions[1].DLQArgs())
	}
}

// On the broker here (3.x), the topology is declared with the version it
// gives, and a DLQ read thirty times (more than RabbitMQ 4's default limit
// of 20) still holds its letter.
func TestDLQReadsDoNotDropLetters(t *testing.T) {
	t.Parallel()
	conn := testamqp.Dial(t)
	version := consumer.BrokerVersion(conn)
	if version == "" {
		t.Fatal("the broker gave no version")
	}
	q := testamqp.Name(t, "idemq-test-dlqreads")
	topo := consumer.NewTopology(consumer.TopologyConfig{Queue: q})
	queues, exchanges := topo.Names()
	testamqp.DeleteQueuesAtCleanup(t, queues, exchanges)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := consumer.Apply(ctx, testamqp.URL(), consumer.TopologyConfig{Queue: q}); err != nil {
		t.Fatalf("apply on %s: %v", version, err)
	}
	ch := testamqp.Channel(t, conn)
	testamqp.Publish(t, ch, "", topo.DLQ, amqp.Publishing{MessageId: "letter", Body: []byte("x")})
	for i := range 30 {
		reader, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(10 * time.Second)
		for {
			_, ok, err := reader.Get(topo.DLQ, false)
			if err != nil {
				t.Fatalf("read %d: %v", i+1, err)
			}
			if ok {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("read %d on %s: the letter is gone", i+1, version)
			}
			<-time.After(10 * time.Millisecond) // the previous read's return is applied shortly after its channel closes
		}
		_ = reader.Close() // gives the letter back
	}
}
