package consumer_test

import (
	"context"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
)

// TestHandlerFailuresAreLogged: a failing handler is logged when its message
// is sent to a retry tier (WARN handler failed), and a dead letter has one
// line, ERROR dead-lettered, not a second one saying its handler failed;
// each with the outcome, the reason and the key hash, never the key.
func TestHandlerFailuresAreLogged(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		logs := &logRecords{}
		h := newHarness(t, m, func(c *consumer.Config) { c.Logger = logs.logger() })
		var calls atomic.Int64
		h.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			if d.Key == "poison-secret-key" {
				return consumer.Response{}, consumer.Permanent(errInfra)
			}
			if calls.Add(1) == 1 {
				return consumer.Response{}, errInfra
			}
			return h.ledgerEffect(ctx, tx, d)
		})
		h.publish("retry-secret-key", `{"amount":1}`, nil)
		evs := h.waitEvents(30*time.Second, "the retry", func(evs []consumer.Event) bool {
			return countOutcomes(evs)[consumer.OutcomeRetried] >= 1
		})
		retried := evs[0]
		h.publish("poison-secret-key", `{"amount":2}`, nil)
		evs = h.waitEvents(30*time.Second, "both messages to end", func(evs []consumer.Event) bool { return finals(evs) >= 2 })
		var poison consumer.Event
		for _, ev := range evs {
			if ev.Outcome == consumer.OutcomeDeadLettered {
				poison = ev
			}
		}

		for _, tc := range []struct {
			ev      consumer.Event
			msg     string
			level   slog.Level
			outcome consumer.Outcome
			reason  string
		}{
			{retried, "handler failed", slog.LevelWarn, consumer.OutcomeRetried, "handler_error"},
			{poison, "dead-lettered", slog.LevelError, consumer.OutcomeDeadLettered, consumer.ReasonPermanentError},
		} {
			lines := logs.withAttr("key_hash", tc.ev.KeyHash)
			if len(lines) != 1 {
				t.Fatalf("%d lines about the %s message, want 1 (%s):%s", len(lines), tc.outcome, tc.msg, logs.all())
			}
			r := lines[0]
			if r.msg != tc.msg || r.level != tc.level || r.attrs["outcome"] != string(tc.outcome) || r.attrs["reason"] != tc.reason || r.attrs["attempt"] != "1" {
				t.Errorf("logged %s %q outcome=%s reason=%s attempt=%s; want %s %q %s %s 1",
					r.level, r.msg, r.attrs["outcome"], r.attrs["reason"], r.attrs["attempt"], tc.level, tc.msg, tc.outcome, tc.reason)
			}
			if !strings.Contains(r.attrs["err"], errInfra.Error()) {
				t.Errorf("logged err=%q; want the handler's error", r.attrs["err"])
			}
		}
		if all := logs.all(); strings.Contains(all, "secret-key") {
			t.Errorf("a raw key in the logs:%s", all)
		}
	})
}
