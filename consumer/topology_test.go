package consumer_test

import (
	"context"
	"errors"
	"net"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testamqp"
	amqp "github.com/rabbitmq/amqp091-go"
)

// A consumer declares the topology its TopologyConfig shapes, and a
// TopologyConfig left zero takes the defaults a Config takes.
func TestTopologyConfigOfAConsumer(t *testing.T) {
	t.Parallel()
	cfg := consumer.Config{
		URL: "amqp://127.0.0.1:1/", Queue: "orders", Name: "n",
		MaxAttempts: 4, RetryInitial: 200 * time.Millisecond, RetryMultiplier: 2, DeliveryLimit: 7, ClassicQueues: true,
	}
	direct := consumer.TopologyConfig{
		Queue: "orders", MaxAttempts: 4, RetryInitial: 200 * time.Millisecond, RetryMultiplier: 2, DeliveryLimit: 7, ClassicQueues: true,
	}
	if got, want := consumer.NewTopology(cfg.TopologyConfig()), consumer.NewTopology(direct); !reflect.DeepEqual(got, want) {
		t.Fatalf("topology of the consumer config %+v, of the topology config %+v", got, want)
	}
	bare := consumer.Config{Queue: "orders", Name: "n"}
	if got, want := consumer.NewTopology(bare.TopologyConfig()), consumer.NewTopology(consumer.TopologyConfig{Queue: "orders"}); !reflect.DeepEqual(got, want) {
		t.Fatalf("defaults differ: consumer %+v, topology config %+v", got, want)
	}
	if tc := bare.TopologyConfig(); tc.ConnectionName != "idemq-n" || tc.DialTimeout != consumer.DefaultDialTimeout {
		t.Fatalf("connection name %q, dial timeout %s", tc.ConnectionName, tc.DialTimeout)
	}
	if err := consumer.Apply(t.Context(), "amqp://127.0.0.1:1/", consumer.TopologyConfig{}); err == nil {
		t.Fatal("Apply without a queue name succeeded")
	}
}

// silentBroker accepts TCP connections and never answers the AMQP
// handshake. Each accepted connection is sent on the returned channel.
func silentBroker(t *testing.T) (url string, accepted <-chan net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ch := make(chan net.Conn, 8)
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			ch <- c
		}
	})
	t.Cleanup(func() {
		_ = ln.Close()
		wg.Wait()
		close(ch)
		for c := range ch {
			_ = c.Close()
		}
	})
	return "amqp://guest:guest@" + ln.Addr().String() + "/", ch
}

// Apply's connect is bounded by DialTimeout, and ends when its context does,
// even while the broker does not answer the handshake.
func TestApplyIsBoundedByItsDialTimeoutAndContext(t *testing.T) {
	t.Parallel()
	t.Run("dial timeout", func(t *testing.T) {
		t.Parallel()
		url, _ := silentBroker(t)
		start := time.Now()
		err := consumer.Apply(t.Context(), url, consumer.TopologyConfig{Queue: "q", DialTimeout: 300 * time.Millisecond})
		if err == nil || time.Since(start) > 10*time.Second {
			t.Fatalf("Apply against a silent broker: %v after %s, want an error after about 300ms", err, time.Since(start))
		}
	})
	t.Run("context", func(t *testing.T) {
		t.Parallel()
		url, accepted := silentBroker(t)
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() {
			done <- consumer.Apply(ctx, url, consumer.TopologyConfig{Queue: "q", DialTimeout: time.Hour})
		}()
		select {
		case <-accepted:
		case <-time.After(10 * time.Second):
			t.Fatal("Apply did not connect")
		}
		cancel()
		select {
		case err := <-done:
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("Apply after its context ended: %v, want one wrapping context.Canceled", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("Apply did not end with its context")
		}
	})
}

// TestQuorumInitialGroupSize: x-quorum-initial-group-size is set on every
// quorum queue only when asked for, and the broker takes it.
func TestQuorumInitialGroupSize(t *testing.T) {
	t.Parallel()
	plain := consumer.NewTopology(consumer.TopologyConfig{Queue: "q"})
	if _, ok := plain.WorkQueueArgs()["x-quorum-initial-group-size"]; ok {
		t.Errorf("x-quorum-initial-group-size set without being asked for: %v", plain.WorkQueueArgs())
	}
	cfg := consumer.TopologyConfig{Queue: testamqp.Name(t, "q-group"), QuorumInitialGroupSize: 1}
	topo := consumer.NewTopology(cfg)
	for _, args := range []amqp.Table{topo.WorkQueueArgs(), topo.TierArgs(topo.Delays[0]), topo.DLQArgs()} {
		if got := args["x-quorum-initial-group-size"]; got != int64(1) {
			t.Errorf("x-quorum-initial-group-size %v, want 1 in %v", got, args)
		}
	}
	if classic := consumer.NewTopology(consumer.TopologyConfig{Queue: "q", ClassicQueues: true, QuorumInitialGroupSize: 3}); classic.WorkQueueArgs()["x-quorum-initial-group-size"] != nil {
		t.Errorf("a classic queue given x-quorum-initial-group-size")
	}
	queues := []string{topo.Queue, topo.DLQ}
	for _, d := range topo.Delays {
		queues = append(queues, topo.TierName(d))
	}
	testamqp.DeleteQueuesAtCleanup(t, queues, []string{topo.DLX})
	if err := consumer.Apply(t.Context(), testamqp.URL(), cfg); err != nil {
		t.Fatalf("apply with an initial group size of 1: %v", err)
	}
	// Idempotent with the same setting.
	if err := consumer.Apply(t.Context(), testamqp.URL(), cfg); err != nil {
		t.Fatalf("apply again: %v", err)
	}
}
