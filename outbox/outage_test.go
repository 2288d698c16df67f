package outbox_test

import (
	"context"
	"log/slog"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
)

// TestRelayOutageIsLoggedOnce: the broker goes out of reach under a running
// relay (its TCP connections cut, every reconnect closed at once) while the
// relay's lanes retry many times: the outage is one WARN line when it
// starts, none while it lasts (shorter than the interval), and one INFO line
// when it ends, with its duration; the rows enqueued meanwhile are
// published.
func TestRelayOutageIsLoggedOnce(t *testing.T) {
	t.Parallel()
	p := testamqp.NewProxy(t)
	e := newEnv(t, 8)
	var logs syncBuffer
	cfg := e.relayConfig(t)
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	cfg.ReconnectInitial, cfg.ReconnectMax = 10*time.Millisecond, 50*time.Millisecond
	r := startRelayURL(t, e.ob, p.URL, cfg)
	c := e.collect(t)
	committed, _ := e.enqueueRows(t, 10, 1, 10, 0)
	e.waitAllPublished(t, c, committed, 10)

	p.Cut()
	waitFor(t, 30*time.Second, "20 reconnect attempts", func() bool {
		s, err := r.Stats(context.Background())
		return err == nil && s.Reconnects >= 20
	})
	p.Restore(t)
	more, _ := e.enqueueRows(t, 10, 1, 10, 0)
	waitFor(t, 30*time.Second, "the rows enqueued during the outage published", func() bool {
		_, total := c.counts()
		return e.backlog(t).Pending == 0 && total >= len(committed)+len(more)
	})
	waitFor(t, 10*time.Second, "the recovery line", func() bool {
		return strings.Contains(logs.String(), "outbox relay broker connection recovered")
	})

	out := logs.String()
	t.Logf("the relay's logs:\n%s", out)
	var warns, starts, recovered []string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		switch {
		case strings.Contains(line, "broker connection recovered"):
			recovered = append(recovered, line)
		case strings.Contains(line, "level=WARN") && strings.Contains(line, "broker"):
			warns = append(warns, line)
			if strings.Contains(line, "lost the broker connection") || strings.Contains(line, "cannot reach the broker") {
				starts = append(starts, line)
			}
		}
	}
	if len(starts) != 1 || len(warns) != 1 {
		t.Errorf("%d lines start the outage, %d WARN lines about the broker; want 1 and 1:\n%s", len(starts), len(warns), out)
	}
	if len(recovered) != 1 || !strings.Contains(recovered[0], "level=INFO") ||
		!regexp.MustCompile(` after=[0-9.]+(ms|s) failures=[0-9]+`).MatchString(recovered[0]) {
		t.Errorf("want one INFO line of the recovery with its duration and failures:\n%s", out)
	}
	if strings.Contains(out, "guest:guest") {
		t.Errorf("a URL with its password in the logs:\n%s", out)
	}
}

// TestRelayDatabaseOutageIsLoggedOnce: Postgres goes out of reach under a
// running relay (its connections closed, each new one at once) while its
// lanes and its LISTEN connection retry many times; the outage is one WARN
// line when it starts, none while it lasts (shorter than the interval), and
// one INFO line when it ends, with its duration; the rows enqueued after it
// are published.
func TestRelayDatabaseOutageIsLoggedOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 8)
	p := testdb.NewProxy(t)
	ob, err := outbox.New(p.Pool(t, 8), &outbox.Config{Schema: e.schema})
	if err != nil {
		t.Fatal(err)
	}
	var logs syncBuffer
	cfg := e.relayConfig(t)
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	cfg.PollInterval = 20 * time.Millisecond
	startRelayOf(t, ob, cfg)
	c := e.collect(t)
	committed, _ := e.enqueueRows(t, 10, 1, 10, 0)
	e.waitAllPublished(t, c, committed, 10)

	p.Cut()
	waitFor(t, 30*time.Second, "20 connections turned away", func() bool { return p.Refused() >= 20 })
	p.Restore()
	waitFor(t, 30*time.Second, "the recovery line", func() bool {
		return strings.Contains(logs.String(), "outbox relay database connection recovered")
	})
	more, _ := e.enqueueRows(t, 10, 1, 10, 0)
	waitFor(t, 30*time.Second, "the rows enqueued after the outage published", func() bool {
		_, total := c.counts()
		return e.backlog(t).Pending == 0 && total >= len(committed)+len(more)
	})

	out := logs.String()
	t.Logf("the relay's logs:\n%s", out)
	var warns, recovered []string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		switch {
		case strings.Contains(line, "database connection recovered"):
			recovered = append(recovered, line)
		case strings.Contains(line, "level=WARN"):
			warns = append(warns, line)
		}
	}
	if len(warns) != 1 || !strings.Contains(warns[0], "database error") && !strings.Contains(warns[0], "LISTEN connection failed") {
		t.Errorf("%d WARN lines; want 1, the start of the database outage:\n%s", len(warns), out)
	}
	if len(recovered) != 1 || !strings.Contains(recovered[0], "level=INFO") ||
		!regexp.MustCompile(` after=[0-9.]+(ms|s) failures=[0-9]+`).MatchString(recovered[0]) {
		t.Errorf("want one INFO line of the recovery with its duration and failures:\n%s", out)
	}
}
