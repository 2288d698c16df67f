package dlq

import (
	"errors"
	"time"

	"github.com/idemq/idemq/internal/wire"
)

// Doomed returns why a dead letter with reason would come straight back to
// the DLQ if it were replayed unchanged, "" when a replay may succeed: the
// consumer dead-letters it for what the message is (its key, its headers),
// not for a failure that may have passed. Replay leaves such letters in the
// DLQ unless ReplayOptions.Doomed.
func Doomed(reason string) string {
	switch reason {
	case wire.ReasonKeyRequired:
		return "it carries no idempotency key: the consumer dead-letters it again at once"
	case wire.ReasonKeyInvalid:
		return "its key (or tenant) is not one the consumer accepts: the consumer dead-letters it again at once"
	case wire.ReasonKeyReuse:
		return "its key was first used for another operation, which the store still holds: it comes straight back, and runs only once retention has deleted that key"
	case wire.ReasonHeadersTooLarge:
		return "its largest headers were dropped to dead-letter it: a replay runs it without them, or it comes straight back"
	case wire.ReasonSequenceInvalid:
		return "its x-ordering-key or x-sequence is not valid: the consumer dead-letters it again at once"
	}
	return ""
}

// Age returns how long before now the operation of dead letter l may have
// begun: since the earliest of its x-idemq-first-seen, its timestamp
// property and its latest x-death time. A key is completed after its
// message was first seen, so a letter younger than the key retention still
// finds its key, if it was completed. ok is false when l carries none of
// the three.
func Age(l wire.Letter, now time.Time) (age time.Duration, ok bool) {
	var earliest time.Time
	consider := func(t time.Time) {
		if !t.IsZero() && (earliest.IsZero() || t.Before(earliest)) {
			earliest = t
		}
	}
	if t, err := time.Parse(time.RFC3339Nano, l.FirstSeen); err == nil {
		consider(t)
	}
	if l.Timestamp != nil {
		consider(*l.Timestamp)
	}
	if l.DeathTime != nil {
		consider(*l.DeathTime)
	}
	if earliest.IsZero() {
		return 0, false
	}
	return max(now.Sub(earliest), 0), true
}

// OlderThan reports whether dead letter l may be older than retention (Age;
// a letter that carries no time may be): its key may be gone, and a replay
// would run it again even if its operation was completed once.
func OlderThan(l wire.Letter, retention time.Duration, now time.Time) bool {
	age, ok := Age(l, now)
	return !ok || age > retention
}

// ErrOlderThanRetention means Replay left dead letters older than the key
// retention in the DLQ (ReplayOptions.OlderThanRetention replays them).
var ErrOlderThanRetention = errors.New("older than the key retention: their key may be gone, and they would run again")
