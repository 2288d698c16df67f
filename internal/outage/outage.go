// Package outage logs the outage of a service (the broker, the database) the
// way an operator reads it: one line when it starts, at most one line per
// interval while it lasts (saying how long it has lasted and how many
// failures came since the last line), and one line when it ends, with its
// duration. The consumer's reconnects and the outbox relay's both log
// through it, so that an outage of eleven seconds reads as two lines, not
// one per retry.
//
// # Lines
//
//   - the first failure: WARN, the caller's message, its attributes and err;
//   - while it lasts, at most once per Interval: WARN "<subject> still down"
//     with down_for, failures (since the previous line) and the latest err;
//   - the first success after: INFO "<subject> recovered" with after (the
//     outage's duration) and failures (all of the outage's).
//
// Errors are redacted (internal/redact): no URL with its credentials.
package outage

import (
	"cmp"
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/idemq/idemq/internal/redact"
)

// DefaultInterval is how often, at most, a lasting outage is logged again.
const DefaultInterval = 30 * time.Second

// Log tracks the outages of one service and logs them. It is safe for
// concurrent use: the lanes of a relay share one.
type Log struct {
	log      *slog.Logger
	subject  string
	interval time.Duration
	now      func() time.Time

	mu       sync.Mutex
	since    time.Time // start of the outage; zero while the service is up
	last     time.Time // of the outage's latest line
	failures int       // since the outage's latest line
	total    int       // in the outage
}

// New returns the outage log of subject (what the later lines name: "broker
// connection", "database connection") on log, logging a lasting outage
// again at most once per interval (0: DefaultInterval).
func New(log *slog.Logger, subject string, interval time.Duration) *Log {
	return &Log{log: log, subject: subject, interval: cmp.Or(interval, DefaultInterval), now: time.Now}
}

// Failed records a failure. The first of an outage is logged with msg,
// attrs and err; later ones at most once per interval, as "<subject> still
// down".
func (l *Log) Failed(ctx context.Context, msg string, err error, attrs ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	l.total++
	if l.since.IsZero() {
		l.since, l.last, l.failures = now, now, 0
		l.log.WarnContext(ctx, msg, append(attrs, "err", redact.Error(err))...)
		return
	}
	l.failures++
	if now.Sub(l.last) < l.interval {
		return
	}
	l.log.WarnContext(ctx, l.subject+" still down",
		"down_for", now.Sub(l.since).Round(time.Millisecond), "failures", l.failures, "err", redact.Error(err))
	l.last, l.failures = now, 0
}

// Attempt returns the time an attempt starts at, on the log's clock: what
// Recovered takes when it succeeds.
func (l *Log) Attempt() time.Time { return l.now() }

// Recovered records the success of an attempt begun at started (Attempt):
// the end of the outage, logged with its duration, if one was going on and
// began before the attempt did. A success of an attempt begun before the
// outage's first failure (another lane's batch that was already under way
// when the connection was cut) says nothing of the service now: it ends
// nothing.
func (l *Log) Recovered(ctx context.Context, started time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.since.IsZero() || started.Before(l.since) {
		return
	}
	l.log.InfoContext(ctx, l.subject+" recovered",
		"after", l.now().Sub(l.since).Round(time.Millisecond), "failures", l.total)
	l.since, l.total, l.failures = time.Time{}, 0, 0
}

// Down reports whether an outage is going on.
func (l *Log) Down() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return !l.since.IsZero()
}
