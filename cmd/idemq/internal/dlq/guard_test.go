package dlq_test

import (
	"context"
	"errors"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/cmd/idemq/internal/dlq"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/wire"
)

// Every reason is either one a replay may cure or one Doomed explains.
func TestDoomedReasons(t *testing.T) {
	doomed := map[string]bool{wire.ReasonKeyRequired: true, wire.ReasonKeyInvalid: true, wire.ReasonKeyReuse: true,
		wire.ReasonHeadersTooLarge: true, wire.ReasonSequenceInvalid: true}
	for _, r := range []string{wire.ReasonPermanentError, wire.ReasonMaxAttemptsExceeded, wire.ReasonKeyRequired, wire.ReasonKeyInvalid,
		wire.ReasonKeyReuse, wire.ReasonHeadersTooLarge, wire.ReasonSequenceGap, wire.ReasonSequenceInvalid, wire.ReasonDeliveryLimit,
		wire.ReasonExpired, wire.ReasonMaxLen, wire.ReasonRejected, wire.ReasonUnknown} {
		if got := dlq.Doomed(r) != ""; got != doomed[r] {
			t.Errorf("Doomed(%s) = %q, want doomed %v", r, dlq.Doomed(r), doomed[r])
		}
	}
}

// A letter's age is since the earliest time it carries; one that carries
// none may be of any age.
func TestAge(t *testing.T) {
	now := time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC)
	ts, died := now.Add(-30*time.Hour), now.Add(-2*time.Hour)
	for _, c := range []struct {
		name string
		l    wire.Letter
		age  time.Duration
		ok   bool
	}{
		{"first seen", wire.Letter{FirstSeen: now.Add(-time.Hour).Format(time.RFC3339Nano)}, time.Hour, true},
		{"timestamp earlier", wire.Letter{FirstSeen: now.Add(-time.Hour).Format(time.RFC3339Nano), Timestamp: &ts}, 30 * time.Hour, true},
		{"x-death only", wire.Letter{DeathTime: &died}, 2 * time.Hour, true},
		{"none", wire.Letter{FirstSeen: "not a time"}, 0, false},
	} {
		if age, ok := dlq.Age(c.l, now); age != c.age || ok != c.ok {
			t.Errorf("%s: %s %v, want %s %v", c.name, age, ok, c.age, c.ok)
		}
	}
	if !dlq.OlderThan(wire.Letter{}, 24*time.Hour, now) {
		t.Error("a letter without a time: want older than any retention")
	}
}

// Replay leaves the letters that would come straight back, and those older
// than the key retention (with ErrOlderThanRetention), unless told.
func TestReplayGuards(t *testing.T) {
	t.Parallel()
	conn, q := setup(t, 0)
	ch := testamqp.Channel(t, conn)
	now := time.Now()
	letter := func(id, reason string, firstSeen time.Time) {
		testamqp.Publish(t, ch, "", dlq.Name(q), amqp.Publishing{MessageId: id, Body: []byte("x"), Headers: amqp.Table{
			wire.HeaderReason: reason, wire.HeaderFirstSeen: firstSeen.UTC().Format(time.RFC3339Nano)}})
	}
	letter("new-ok", "permanent_error", now.Add(-time.Hour))
	letter("new-reuse", "idempotency_key_reuse", now.Add(-time.Hour))
	letter("old-ok", "max_attempts_exceeded", now.Add(-48*time.Hour))
	letter("old-missing", "idempotency_key_required", now.Add(-48*time.Hour))
	waitReady(t, conn, dlq.Name(q), 4)
	ctx := context.Background()

	res, err := dlq.Replay(ctx, conn, dlq.ReplayOptions{Queue: dlq.Name(q), Target: q, Retention: 24 * time.Hour})
	if !errors.Is(err, dlq.ErrOlderThanRetention) || res.Replayed != 1 || res.Doomed != 2 || res.Old != 1 {
		t.Fatalf("replay: %+v %v, want 1 replayed, 2 doomed, 1 old and ErrOlderThanRetention", res, err)
	}
	waitReady(t, conn, q, 1)
	waitReady(t, conn, dlq.Name(q), 3)

	res, err = dlq.Replay(ctx, conn, dlq.ReplayOptions{Queue: dlq.Name(q), Target: q, Retention: 24 * time.Hour, OlderThanRetention: true})
	if err != nil || res.Replayed != 1 || res.Doomed != 2 || res.Old != 0 {
		t.Fatalf("replay --older-than-retention: %+v %v", res, err)
	}
	waitReady(t, conn, q, 2)
	waitReady(t, conn, dlq.Name(q), 2) // the letters left are back
	res, err = dlq.Replay(ctx, conn, dlq.ReplayOptions{Queue: dlq.Name(q), Target: q, Retention: 24 * time.Hour, Doomed: true})
	if !errors.Is(err, dlq.ErrOlderThanRetention) || res.Replayed != 1 || res.Doomed != 0 || res.Old != 1 || res.ByReason["idempotency_key_reuse"] != 1 {
		t.Fatalf("replay doomed: %+v %v", res, err)
	}
	waitReady(t, conn, q, 3)
	waitReady(t, conn, dlq.Name(q), 1)
}
