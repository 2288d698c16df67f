package outbox_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TestRelaySkipsADeadAddress: a relay given a list with an address that
// refuses every connect publishes everything, whichever order it tries.
func TestRelaySkipsADeadAddress(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, url string }{
		{"dead first", "amqp://guest:guest@127.0.0.1:1/," + testamqp.URL()},
		{"dead last", testamqp.URL() + ",amqp://guest:guest@127.0.0.1:1/"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			const n = 200
			e := newEnv(t, 8)
			startRelayURL(t, e.ob, tc.url, e.relayConfig(t))
			c := e.collect(t)
			committed, _ := e.enqueueRows(t, n, 2, 20, 0)
			e.waitAllPublished(t, c, committed, n)
		})
	}
}

// TestRelayFailsOverToAnotherNode: the node a relay publishes through goes
// away mid-run; its lanes resume through the other address of the list and
// every row is published, none lost.
func TestRelayFailsOverToAnotherNode(t *testing.T) {
	t.Parallel()
	const n = 2000
	a, b := testamqp.NewProxy(t), testamqp.NewProxy(t)
	e := newEnv(t, 8)
	cfg := e.relayConfig(t)
	cfg.BatchSize = 50
	cfg.ReconnectInitial = 50 * time.Millisecond
	r := startRelayURL(t, e.ob, a.URL+","+b.URL, cfg)
	c := e.collect(t)

	done := make(chan []string, 1)
	go func() {
		ids, _ := e.enqueueRows(t, n, 4, 25, 0)
		done <- ids
	}()
	waitFor(t, 30*time.Second, "300 messages", func() bool {
		_, total := c.counts()
		return total >= 300
	})
	on, other := a, b
	if a.Active() == 0 {
		on, other = b, a
	}
	on.Kill()
	committed := <-done
	dups := e.waitAllPublished(t, c, committed, n)
	if other.Active() == 0 {
		t.Errorf("no connection through the address left")
	}
	s, err := r.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d messages, %d republished after the failover (same message id), %d reconnects", n, dups, s.Reconnects)
}

// TestNewRelayRefusesABadURLInTheList names the bad URL without its
// credentials.
func TestNewRelayRefusesABadURLInTheList(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	_, err := outbox.NewRelay(e.ob, testamqp.URL()+",http://user:s3cret@node2/", nil)
	if err == nil || strings.Contains(err.Error(), "s3cret") || !strings.Contains(err.Error(), "http://xxxxx@node2/") {
		t.Fatalf("NewRelay: %v; want an error naming the bad URL, redacted", err)
	}
}

// TestRelayOnAReadOnlyServer: a relay whose pool lands on a read-only
// server (a standby: default_transaction_read_only) cannot claim rows (FOR
// UPDATE is a write, SQLSTATE 25006); it backs off, publishes nothing and
// loses nothing, and a relay on the writable server then publishes them all.
func TestRelayOnAReadOnlyServer(t *testing.T) {
	t.Parallel()
	const n = 20
	e := newEnv(t, 4)
	// The standby is played by a session setting given at connect, which
	// a pooler does not pass on: straight to Postgres.
	pcfg, err := pgxpool.ParseConfig(testdb.DirectURL())
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = 4
	pcfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	roPool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(roPool.Close)
	roOutbox, err := outbox.New(roPool, &outbox.Config{Schema: e.schema})
	if err != nil {
		t.Fatal(err)
	}
	var logs syncBuffer
	cfg := e.relayConfig(t)
	cfg.NoNotify = true
	cfg.PollInterval = 20 * time.Millisecond
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	committed, _ := e.enqueueRows(t, n, 1, n, 0)
	c := e.collect(t)

	r, err := outbox.NewRelay(roOutbox, testamqp.URL(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	waitFor(t, 20*time.Second, "the relay to report the read-only server", func() bool {
		return strings.Contains(logs.String(), "SQLSTATE 25006")
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("run on the read-only server: %v", err)
	}
	if b := e.backlog(t); b.Pending != n {
		t.Fatalf("pending = %d after the read-only relay, want %d", b.Pending, n)
	}
	if _, total := c.counts(); total != 0 {
		t.Fatalf("%d messages published from a read-only server, want 0", total)
	}

	startRelayOf(t, e.ob, e.relayConfig(t))
	e.waitAllPublished(t, c, committed, n)
}
