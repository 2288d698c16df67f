package outage

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// TestOutageLog: an outage is one line when it starts, at most one per
// interval while it lasts (with down_for and the failures since the
// previous line), one when it ends (with its duration); a success while up
// logs nothing, and the next outage starts afresh. No URL password shows.
func TestOutageLog(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Key == slog.TimeKey {
				return slog.Attr{}
			}
			return a
		},
	}))
	clock := time.Unix(1700000000, 0)
	l := New(log, "broker connection", 10*time.Second)
	l.now = func() time.Time { return clock }
	ctx := context.Background()
	err := errors.New("dial amqp://guest:s3cret@mq:5672/: connection refused")

	l.Recovered(ctx, l.Attempt()) // up: nothing
	early := l.Attempt()          // an attempt under way when the outage starts
	clock = clock.Add(time.Millisecond)
	for range 43 { // one failure every 250 ms for 10.75 s
		l.Failed(ctx, "broker connection lost; reconnecting", err, "in", time.Second)
		clock = clock.Add(250 * time.Millisecond)
	}
	if !l.Down() {
		t.Fatal("Down is false during an outage")
	}
	l.Recovered(ctx, early) // begun before the outage: ends nothing
	if !l.Down() {
		t.Fatal("a success of an attempt begun before the outage ended it")
	}
	l.Recovered(ctx, l.Attempt())
	l.Recovered(ctx, l.Attempt()) // up again: nothing
	if l.Down() {
		t.Fatal("Down is true after the recovery")
	}
	l.Failed(ctx, "broker connection lost; reconnecting", err)
	clock = clock.Add(1500 * time.Millisecond)
	l.Recovered(ctx, l.Attempt())

	want := []string{
		`level=WARN msg="broker connection lost; reconnecting" in=1s err="dial amqp://xxxxx@mq:5672/: connection refused"`,
		`level=WARN msg="broker connection still down" down_for=10s failures=40 err="dial amqp://xxxxx@mq:5672/: connection refused"`,
		`level=INFO msg="broker connection recovered" after=10.75s failures=43`,
		`level=WARN msg="broker connection lost; reconnecting" err="dial amqp://xxxxx@mq:5672/: connection refused"`,
		`level=INFO msg="broker connection recovered" after=1.5s failures=1`,
	}
	got := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("lines:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if strings.Contains(buf.String(), "s3cret") {
		t.Error("a password in the log")
	}
}

// TestOutageLogDefaults: interval 0 is DefaultInterval.
func TestOutageLogDefaults(t *testing.T) {
	if l := New(slog.New(slog.DiscardHandler), "x", 0); l.interval != DefaultInterval {
		t.Errorf("interval %s, want %s", l.interval, DefaultInterval)
	}
}
