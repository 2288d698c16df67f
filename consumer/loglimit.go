package consumer

import (
	"sync"
	"time"
)

// failureLogsPerSecond is how many handler-failure lines a consumer logs
// per second at most; the lines over it are counted, and the next line
// logged says how many were suppressed.
const failureLogsPerSecond = 10

// logLimiter lets at most limit lines through per window (default: 10 a
// second) and counts the rest. The zero value uses the defaults. It is safe
// for concurrent use.
type logLimiter struct {
	limit  int
	window time.Duration

	mu         sync.Mutex
	start      time.Time // of the current window
	n          int       // lines let through in it
	suppressed int       // since the last line let through
}

// allow reports whether a line may be logged at now, and if so how many
// lines were suppressed since the last one that was.
func (l *logLimiter) allow(now time.Time) (ok bool, suppressed int) {
	limit, window := l.limit, l.window
	if limit <= 0 {
		limit = failureLogsPerSecond
	}
	if window <= 0 {
		window = time.Second
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.Sub(l.start) >= window || now.Before(l.start) {
		l.start, l.n = now, 0
	}
	if l.n >= limit {
		l.suppressed++
		return false, 0
	}
	l.n++
	suppressed, l.suppressed = l.suppressed, 0
	return true, suppressed
}
