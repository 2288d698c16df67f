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
// is sent to a retry tier, not only when it is dead-lettered, with the
// outcome, the reason and the key hash, never the key.
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

		want := map[string]struct {
			level   slog.Level
			outcome consumer.Outcome
			reason  string
		}{
			retried.KeyHash: {slog.LevelWarn, consumer.OutcomeRetried, "handler_error"},
			poison.KeyHash:  {slog.LevelError, consumer.OutcomeDeadLettered, consumer.ReasonPermanentError},
		}
		lines := logs.find("handler failed")
		if len(lines) != 2 {
			t.Fatalf("%d lines say a handler failed, want 2:%s", len(lines), logs.all())
		}
		for _, r := range lines {
			w, ok := want[r.attrs["key_hash"]]
			if !ok {
				t.Fatalf("a failure logged with key hash %q, want one of the two messages':%s", r.attrs["key_hash"], logs.all())
			}
			if r.level != w.level || r.attrs["outcome"] != string(w.outcome) || r.attrs["reason"] != w.reason || r.attrs["attempt"] != "1" {
				t.Errorf("logged %s outcome=%s reason=%s attempt=%s; want %s %s %s 1",
					r.level, r.attrs["outcome"], r.attrs["reason"], r.attrs["attempt"], w.level, w.outcome, w.reason)
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
