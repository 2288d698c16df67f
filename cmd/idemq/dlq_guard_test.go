package main_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testamqp"
)

// `idemq dlq replay` leaves what would come straight back (counted, exit 0)
// and what may have lost its key (older than --key-retention: exit 1),
// and replays each only when asked.
func TestDLQReplayGuards(t *testing.T) {
	t.Parallel()
	queue := testamqp.Name(t, "dlqguard")
	topo := consumer.NewTopology(consumer.TopologyConfig{Queue: queue})
	queues, exchanges := topo.Names()
	testamqp.DeleteQueuesAtCleanup(t, queues, exchanges)
	schema := newSchema(t)
	mustRun(t, env(schema), "topology", "apply", "--queue", queue)
	conn := testamqp.Dial(t)
	ch := testamqp.Channel(t, conn)
	now := time.Now()
	for _, l := range []struct {
		id, reason string
		seen       time.Time
	}{
		{"fresh", consumer.ReasonPermanentError, now.Add(-time.Hour)},
		{"reused", consumer.ReasonKeyReuse, now.Add(-time.Hour)},
		{"old", consumer.ReasonMaxAttemptsExceeded, now.Add(-48 * time.Hour)},
	} {
		testamqp.Publish(t, ch, "", topo.DLQ, amqp.Publishing{MessageId: l.id, Body: []byte("{}"), Headers: amqp.Table{
			consumer.HeaderReason: l.reason, consumer.HeaderFirstSeen: l.seen.UTC().Format(time.RFC3339Nano)}})
	}
	waitDepth := func(q string, n int) {
		t.Helper()
		deadline := time.Now().Add(15 * time.Second)
		for {
			if got, _ := queueState(t, conn, q); got == n {
				return
			}
			if time.Now().After(deadline) {
				got, _ := queueState(t, conn, q)
				t.Fatalf("%s: %d ready, want %d", q, got, n)
			}
			<-time.After(50 * time.Millisecond) // polling a queue: nothing to wait on
		}
	}
	waitDepth(topo.DLQ, 3)

	r := idemq(t, env(schema), "dlq", "replay", "--queue", queue)
	if r.code != 1 || !strings.Contains(r.stdout, "replayed 1, skipped 0, 1 left: their reason cannot succeed unchanged (--allow-doomed), 1 left: older than the key retention (24h0m0s)") ||
		!strings.Contains(r.stderr, "their key may be gone, and they would run again; --older-than-retention replays them") {
		t.Fatalf("dlq replay: %s", r)
	}
	waitDepth(topo.DLQ, 2)
	waitDepth(queue, 1)
	r = mustRun(t, env(schema), "dlq", "replay", "--queue", queue, "--older-than-retention")
	if !strings.Contains(r.stdout, "replayed 1, skipped 0, 1 left: their reason cannot succeed unchanged") {
		t.Fatalf("dlq replay --older-than-retention: %s", r)
	}
	waitDepth(queue, 2)
	waitDepth(topo.DLQ, 1) // the letter left is back
	r = mustRun(t, env(schema), "dlq", "replay", "--queue", queue, "--reason", consumer.ReasonKeyReuse, "--allow-doomed")
	if strings.TrimSpace(r.stdout) != "replayed 1, skipped 0" {
		t.Fatalf("dlq replay --allow-doomed: %s", r)
	}
	waitDepth(queue, 3)
	waitDepth(topo.DLQ, 0)

	// Each replay is in the audit, under the OS user, with what it moved.
	r = mustRun(t, env(schema), "audit", "--json")
	var entries []struct {
		Actor, Via, Action, Target, Result string
		Count                              int
	}
	if err := json.Unmarshal([]byte(r.stdout), &entries); err != nil || len(entries) != 3 {
		t.Fatalf("audit: %v\n%s", err, r.stdout)
	}
	for i, want := range []struct {
		count  int
		result string
	}{{1, "ok"}, {1, "ok"}, {1, "1 dead letter(s) stay in " + topo.DLQ + ", older than the key retention: their key may be gone, and they would run again"}} {
		if e := entries[i]; e.Action != "dlq.replay" || e.Via != "cli" || e.Actor == "" || e.Target != queue || e.Count != want.count || e.Result != want.result {
			t.Errorf("audit entry %d: %+v, want %d and %q", i, e, want.count, want.result)
		}
	}
	if r := mustRun(t, env(schema), "audit"); !strings.Contains(r.stdout, "dlq.replay") || !strings.Contains(r.stdout, "AT ") {
		t.Errorf("audit text: %s", r)
	}
}
