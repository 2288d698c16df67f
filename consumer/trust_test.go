package consumer_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/keystore"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/wire"
)

// logBuffer captures a consumer's logs.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

func (l *logBuffer) logger() *slog.Logger { return slog.New(slog.NewTextHandler(l, nil)) }

// noReconnect fails the test at once if the consumer lost its session.
func noReconnect(t *testing.T, logs *logBuffer) {
	t.Helper()
	if s := logs.String(); strings.Contains(s, "reconnecting") {
		t.Fatalf("the consumer lost its broker session:\n%s", s)
	}
}

// TestTenantFromUserIDCopiesKeepTheTenant publishes as a second broker user,
// with user_id set, to a consumer that takes the tenant from user_id. The
// first run fails (infrastructure: a retry copy) while a second copy finds
// the key busy (a retry-later copy). Neither copy may carry alice's user_id
// (RabbitMQ refuses it on the worker's connection and closes the channel),
// and both must still be handled as alice's: one effect, under tenant alice.
//
// Where the key has a lease others can see: a copy of a held key waits for
// the holder's commit instead of finding it busy.
func TestTenantFromUserIDCopiesKeepTheTenant(t *testing.T) {
	forModes(t, mode.Separate, func(t *testing.T, m mode) {
		logs := &logBuffer{}
		h := newHarness(t, m, func(c *consumer.Config) {
			c.TenantFromUserID = true
			c.Logger = logs.logger()
		})
		alice, aliceURL := testamqp.AddUser(t, "alice")
		aliceCh := testamqp.Channel(t, testamqp.DialURL(t, aliceURL))

		var calls atomic.Int64
		started, release := make(chan struct{}), make(chan struct{})
		h.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			if calls.Add(1) == 1 {
				// Hold the lease until a second copy has found the key busy.
				close(started)
				select {
				case <-release:
				case <-ctx.Done():
				}
				return consumer.Response{}, errInfra
			}
			return h.ledgerEffect(ctx, tx, d)
		})
		msg := amqp.Publishing{MessageId: "alice-op", UserId: alice, Body: []byte(`{"amount":5}`)}
		testamqp.Publish(t, aliceCh, "", h.cfg.Queue, msg)
		select {
		case <-started:
		case <-time.After(30 * time.Second):
			t.Fatal("the first copy was not handled within 30s")
		}
		testamqp.Publish(t, aliceCh, "", h.cfg.Queue, msg)
		h.waitEvents(30*time.Second, "the second copy to find the key busy", func(evs []consumer.Event) bool {
			noReconnect(t, logs)
			return countOutcomes(evs)[consumer.OutcomeInProgress] >= 1
		})
		close(release)
		evs := h.waitEvents(60*time.Second, "both copies to end", func(evs []consumer.Event) bool {
			noReconnect(t, logs)
			return finals(evs) >= 2
		})
		noReconnect(t, logs)

		c := countOutcomes(evs)
		if c[consumer.OutcomeRetried] != 1 || c[consumer.OutcomeProcessed] != 1 || c[consumer.OutcomeDuplicate] != 1 || finals(evs) != 2 {
			t.Fatalf("outcomes %v, want 1 retried, 1 processed, 1 duplicate (and in_progress)", c)
		}
		for _, ev := range evs {
			if ev.Tenant != alice {
				t.Errorf("%s under tenant %q, want %q", ev.Outcome, ev.Tenant, alice)
			}
		}
		var tenants []string
		rows, err := h.pool.Query(context.Background(), "SELECT tenant FROM "+h.schema+".ledger WHERE key = 'alice-op'")
		if err != nil {
			t.Fatal(err)
		}
		if tenants, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
			t.Fatal(err)
		}
		if len(tenants) != 1 || tenants[0] != alice {
			t.Fatalf("effects under tenants %q, want one under %q", tenants, alice)
		}
		if rec, err := h.store.Inspect(context.Background(), dedup.Scope{Consumer: "payments", Tenant: alice, Key: "alice-op"}); err != nil || rec.State != dedup.StateCompleted {
			t.Fatalf("alice's key: %+v, %v; want completed", rec, err)
		}
		if _, err := h.store.Inspect(context.Background(), dedup.Scope{Consumer: "payments", Key: "alice-op"}); !errors.Is(err, dedup.ErrNotFound) {
			t.Fatalf("the key under the default tenant: %v, want ErrNotFound", err)
		}
		if dl := h.drainDLQ(); len(dl) != 0 {
			t.Fatalf("%d dead letters, want none", len(dl))
		}
	})
}

// TestForgedAttemptCountsAsFirst publishes a message whose publisher wrote
// x-idemq-attempt: 999 itself. Its first failure must retry it (attempt 1 of
// 3), not dead-letter it as if it had run out of attempts.
func TestForgedAttemptCountsAsFirst(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, nil)
		var mu sync.Mutex
		var attempts []int
		h.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			mu.Lock()
			attempts = append(attempts, d.Attempt)
			n := len(attempts)
			mu.Unlock()
			if n == 1 {
				return consumer.Response{}, errInfra
			}
			return h.ledgerEffect(ctx, tx, d)
		})
		h.publish("forged-attempt", `{}`, amqp.Table{consumer.HeaderAttempt: int32(999)})
		evs := h.waitEvents(30*time.Second, "the message to end", func(evs []consumer.Event) bool { return finals(evs) >= 1 })
		if c := countOutcomes(evs); c[consumer.OutcomeRetried] != 1 || c[consumer.OutcomeProcessed] != 1 {
			t.Fatalf("outcomes %v, want 1 retried then 1 processed", c)
		}
		mu.Lock()
		defer mu.Unlock()
		if len(attempts) != 2 || attempts[0] != 1 || attempts[1] != 2 {
			t.Fatalf("the handler saw attempts %v, want [1 2]", attempts)
		}
	})
}

// schemaKeys are the header keys migrating the harness's schema created,
// bound to the harness's queue and consumer name.
func (h *harness) schemaKeys() wire.Keys {
	h.t.Helper()
	keys, err := keystore.Of(h.store).HeaderKeys(context.Background())
	if err != nil {
		h.t.Fatal(err)
	}
	out := make(wire.Keys, len(keys))
	for i, k := range keys {
		out[i] = wire.Key{Secret: k.Secret, SignsFrom: k.SignsFrom}
	}
	return out.For(h.cfg.Queue, h.cfg.Name)
}

// TestOnlySignedHeadersAreTrusted publishes copies as idemq writes them
// (attempt 2, tenant alice, an original routing key), signed with the
// schema's key, then the same copies with a signed header altered, a wrong
// key, a forged signature, or signed for another message_id or body. Only
// the intact copy is handled as attempt 2 of alice; every other one is a
// first attempt, its tenant from its user_id (none: ""), and its handler sees
// none of the x-idemq-* headers.
func TestOnlySignedHeadersAreTrusted(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, func(c *consumer.Config) { c.TenantFromUserID = true })
		keys := h.schemaKeys()
		copyHeaders := func(id, body string, ks wire.Keys) amqp.Table {
			t := amqp.Table{
				"x-custom": "kept", wire.HeaderAttempt: int32(2), wire.HeaderTenant: "alice",
				wire.HeaderFirstSeen: "2026-11-30T12:00:00Z", wire.HeaderOriginalExchange: "orders", wire.HeaderOriginalRoutingKey: "orders.created",
			}
			ks.Sign(t, id, []byte(body), time.Now())
			return t
		}
		other := wire.Keys{{Secret: []byte("another deployment's key, 32 b.")}}.For(h.cfg.Queue, h.cfg.Name)
		cases := map[string]amqp.Table{
			"intact":           copyHeaders("intact", "{}", keys),
			"attempt altered":  copyHeaders("attempt altered", "{}", keys),
			"tenant altered":   copyHeaders("tenant altered", "{}", keys),
			"route altered":    copyHeaders("route altered", "{}", keys),
			"wrong key":        copyHeaders("wrong key", "{}", other),
			"forged signature": copyHeaders("forged signature", "{}", keys),
			"other message_id": copyHeaders("a message_id that is not this one", "{}", keys),
			"other body":       copyHeaders("other body", `{"amount":1000000}`, keys),
			"no signature":     copyHeaders("no signature", "{}", keys),
		}
		cases["attempt altered"][wire.HeaderAttempt] = int32(3)
		cases["tenant altered"][wire.HeaderTenant] = "mallory"
		cases["route altered"][wire.HeaderOriginalRoutingKey] = "admin.delete"
		cases["forged signature"][wire.HeaderSignature] = "v2.ttttttttttttttttttttttttttttttttttttttttttt"
		delete(cases["no signature"], wire.HeaderSignature)

		type seen struct {
			attempt int
			tenant  string
			ours    []string
		}
		var mu sync.Mutex
		got := map[string]seen{}
		h.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			s := seen{attempt: d.Attempt, tenant: d.Tenant}
			for k := range d.Headers {
				if strings.HasPrefix(k, wire.Prefix) {
					s.ours = append(s.ours, k)
				}
			}
			mu.Lock()
			got[d.Key] = s
			mu.Unlock()
			return consumer.Response{}, nil
		})
		for id, headers := range cases {
			h.publish(id, "{}", headers)
		}
		h.waitEvents(30*time.Second, "every copy processed", func(evs []consumer.Event) bool { return finals(evs) >= len(cases) })

		mu.Lock()
		defer mu.Unlock()
		for id := range cases {
			s, ok := got[id]
			switch {
			case !ok:
				t.Errorf("%s: not handled", id)
			case id == "intact":
				if s.attempt != 2 || s.tenant != "alice" || len(s.ours) != 6 {
					t.Errorf("%s: attempt %d, tenant %q, idemq headers %q; want attempt 2 of alice, headers kept", id, s.attempt, s.tenant, s.ours)
				}
			default:
				if s.attempt != 1 || s.tenant != "" || len(s.ours) != 0 {
					t.Errorf("%s: attempt %d, tenant %q, idemq headers %q; want a first attempt, tenant \"\", no idemq header", id, s.attempt, s.tenant, s.ours)
				}
			}
		}
	})
}

// TestConfiguredHeaderKeys: with Config.HeaderKeys the first key signs and
// every key verifies (a rotation in progress), and the schema's key is not
// used. A retry copy the consumer wrote verifies under the first key alone.
func TestConfiguredHeaderKeys(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		newKey, oldKey := []byte("the new key of this deployment.."), []byte("the old key of this deployment..")
		h := newHarness(t, m, func(c *consumer.Config) { c.HeaderKeys = [][]byte{newKey, oldKey} })
		signed := func(id string, ks wire.Keys) amqp.Table {
			t := amqp.Table{wire.HeaderAttempt: int32(2)}
			ks.Sign(t, id, []byte("{}"), time.Now())
			return t
		}
		var mu sync.Mutex
		attempts := map[string][]int{}
		var retrySigned bool
		h.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			mu.Lock()
			defer mu.Unlock()
			attempts[d.Key] = append(attempts[d.Key], d.Attempt)
			if d.Key == "fails-once" {
				if d.Attempt == 1 {
					return consumer.Response{}, errInfra
				}
				retrySigned = wire.Keys{{Secret: newKey}}.For(h.cfg.Queue, h.cfg.Name).Verify(d.Headers, d.MessageID, d.Body)
			}
			return consumer.Response{}, nil
		})
		h.publish("old-key", "{}", signed("old-key", wire.Keys{{Secret: oldKey}}.For(h.cfg.Queue, h.cfg.Name)))
		h.publish("schema-key", "{}", signed("schema-key", h.schemaKeys()))
		h.publish("fails-once", "{}", nil)
		h.waitEvents(30*time.Second, "every message processed", func(evs []consumer.Event) bool { return finals(evs) >= 3 })
		mu.Lock()
		defer mu.Unlock()
		// A batch handler runs again alone after a batch-mate failed: the same
		// attempt twice in a row is one attempt.
		for k, a := range attempts {
			attempts[k] = slices.Compact(a)
		}
		if a := attempts["old-key"]; len(a) != 1 || a[0] != 2 {
			t.Errorf("copy signed with the old key: attempts %v, want [2]", a)
		}
		if a := attempts["schema-key"]; len(a) != 1 || a[0] != 1 {
			t.Errorf("copy signed with the schema's key: attempts %v, want [1]", a)
		}
		if a := attempts["fails-once"]; len(a) != 2 || a[0] != 1 || a[1] != 2 || !retrySigned {
			t.Errorf("retried message: attempts %v, retry signed with the new key %v; want [1 2], true", a, retrySigned)
		}

		cfg := h.cfg
		cfg.HeaderKeys = [][]byte{newKey, []byte("too short")}
		if _, err := consumer.New(h.store, h.ledgerEffect, &cfg); err == nil || strings.Contains(err.Error(), "too short") {
			t.Fatalf("New with a 9-byte key: %v, want an error that does not quote the key", err)
		}
	})
}

// TestReplayedDeadLetterKeepsItsTenant: alice's message is dead-lettered
// (permanent error), then replayed as `idemq dlq replay` replays it
// (wire.ReplayCopy, made without a header key). The replayed copy still
// verifies: it is handled as alice's (same key scope), as a first attempt,
// once. (internal/dlq's tests run the replay command itself.)
func TestReplayedDeadLetterKeepsItsTenant(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, func(c *consumer.Config) { c.TenantFromUserID = true })
		alice, aliceURL := testamqp.AddUser(t, "alice")
		aliceCh := testamqp.Channel(t, testamqp.DialURL(t, aliceURL))
		var calls atomic.Int64
		var mu sync.Mutex
		var seen []string
		h.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			mu.Lock()
			seen = append(seen, fmt.Sprintf("%s/%d", d.Tenant, d.Attempt))
			mu.Unlock()
			if calls.Add(1) == 1 {
				return consumer.Response{}, consumer.Permanent(errors.New("not yet"))
			}
			return h.ledgerEffect(ctx, tx, d)
		})
		testamqp.Publish(t, aliceCh, "", h.cfg.Queue, amqp.Publishing{MessageId: "replayed-op", UserId: alice, Body: []byte(`{}`)})
		h.waitEvents(30*time.Second, "the dead letter", func(evs []consumer.Event) bool { return finals(evs) >= 1 })

		dl := h.waitDLQ(1, 10*time.Second)
		if len(dl) != 1 {
			t.Fatalf("%d dead letters, want 1", len(dl))
		}
		testamqp.Publish(t, testamqp.Channel(t, h.conn), "", h.cfg.Queue, wire.ReplayCopy(&dl[0]))
		evs := h.waitEvents(30*time.Second, "the replayed copy", func(evs []consumer.Event) bool { return finals(evs) >= 2 })
		if last := evs[len(evs)-1]; last.Outcome != consumer.OutcomeProcessed || last.Tenant != alice {
			t.Fatalf("replayed copy: %s under tenant %q, want processed under %q", last.Outcome, last.Tenant, alice)
		}
		mu.Lock()
		defer mu.Unlock()
		if want := []string{alice + "/1", alice + "/1"}; fmt.Sprint(seen) != fmt.Sprint(want) {
			t.Fatalf("the handler saw tenant/attempt %v, want %v", seen, want)
		}
		if eff := h.effects(); eff["replayed-op"] != 1 {
			t.Fatalf("effects %v, want one", eff)
		}
	})
}
