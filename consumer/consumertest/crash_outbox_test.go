package consumertest_test

import (
	"context"
	"fmt"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/internal/testamqp"
)

// receiptSetup is crashSetup for chargeWithReceipt, each Subject with a
// receipts queue of its own, checked downstream by check.
func receiptSetup(t *testing.T, mode consumertest.Mode, check func(msgs []amqp.Delivery) error) func(testing.TB) consumertest.Subject {
	ch := testamqp.Channel(t, testamqp.Dial(t))
	var queue string
	return crashSetup(t, mode, func(w *crashWorld) consumer.Handler {
		queue = testamqp.Name(t, "crash-receipts")
		testamqp.DeleteQueuesAtCleanup(t, []string{queue}, nil)
		if _, err := ch.QueueDeclare(queue, false, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		return chargeWithReceipt(w.shop, queue)
	}, func(_ *crashWorld, s *consumertest.Subject) {
		s.Downstream = &consumertest.Downstream{URL: testamqp.URL(), Queue: queue,
			Check: func(_ context.Context, msgs []amqp.Delivery) error { return check(msgs) }}
	})
}

// appliedOnce checks one receipt applied per order, the messages taken
// through key (each one applied, or only the first of each key).
func appliedOnce(key func(amqp.Delivery) string) func(msgs []amqp.Delivery) error {
	return func(msgs []amqp.Delivery) error {
		seen := map[string]bool{}
		applied := map[string]int{}
		for _, m := range msgs {
			if k := key(m); k == "" || !seen[k] {
				seen[k] = k != ""
				applied[string(m.Body)]++
			}
		}
		for _, o := range crashOrders {
			if n := applied[o]; n != 1 {
				return fmt.Errorf("receipt of %s applied %d times", o, n)
			}
		}
		return nil
	}
}

// TestCrashRelayBeforeMark catches a downstream that applies every message
// it gets: the relay that died after the confirms, before marking its rows,
// is followed by one that publishes them again, and each receipt arrives
// twice. Every other point, the outbox's commit before any relay included,
// delivers each receipt once.
func TestCrashRelayBeforeMark(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode consumertest.Mode) {
		rep := consumertest.CrashPoints(t, receiptSetup(t, mode, appliedOnce(func(amqp.Delivery) string { return "" })), crashMessages()...)
		wantFailed(t, rep, map[string]string{consumertest.PointRelayBeforeMark: "receipt of order-1 applied 2 times"})
		if row := rep.Row(consumertest.PointOutboxCommitted); row == nil || !row.Reached {
			t.Fatalf("%s: not run or not reached", consumertest.PointOutboxCommitted)
		}
	})
}

// TestCrashRelayPassesADownstreamThatDedups: the same receipts, applied
// once per message_id (the relay's copies share it), pass at every point.
func TestCrashRelayPassesADownstreamThatDedups(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode consumertest.Mode) {
		rep := consumertest.CrashPoints(t, receiptSetup(t, mode, appliedOnce(func(m amqp.Delivery) string { return m.MessageId })), crashMessages()...)
		wantFailed(t, rep, nil)
		want := []string{
			consumertest.PointNone, consumertest.PointAfterReserve,
			consumertest.PointInStep("charge"), consumertest.PointAfterStep("charge"),
			consumertest.PointBeforeCommit, consumertest.PointAfterCommit,
			consumertest.PointOutboxCommitted, consumertest.PointRelayBeforeMark,
			consumertest.ScenarioDuplicateDuring, consumertest.ScenarioDuplicateAfter, consumertest.ScenarioLeaseExpired,
		}
		wantRows(t, rep, want)
	})
}
