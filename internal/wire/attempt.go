package wire

import (
	"strings"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"
)

// MaxErrorLen bounds x-idemq-error, in bytes (and "…" when cut).
const MaxErrorLen = 1024

// maxAttempt is the largest attempt number read; a larger one is a first
// attempt.
const maxAttempt = 1 << 30

// ParseAttempt reads the attempt number from x-idemq-attempt, as any AMQP
// integer, a float or a decimal string. Absent, unreadable or non-positive
// values count as the first attempt. Read it only from a copy whose
// signature verifies: any other delivery is a first attempt.
func ParseAttempt(h amqp.Table) int {
	n, ok := Int(h[HeaderAttempt])
	if !ok || n < 1 || n > maxAttempt {
		return 1
	}
	return int(n)
}

// RetryHeaders are the headers of a retry copy for attempt next.
func RetryHeaders(next int) amqp.Table {
	return amqp.Table{HeaderAttempt: int32(next)}
}

// DeadLetterHeaders are the headers of a dead-lettered copy: the reason, the
// error text (the reason when err is nil; at most MaxErrorLen bytes) and the
// attempts made; its x-idemq-attempt is 1, a replay's first attempt.
func DeadLetterHeaders(reason string, err error, attempts int) amqp.Table {
	text := reason
	if err != nil {
		text = err.Error()
	}
	return amqp.Table{
		HeaderReason:   reason,
		HeaderError:    Truncate(text, MaxErrorLen),
		HeaderAttempts: int32(attempts),
		// The attempt a replay (idemq dlq replay) starts at: signed with
		// the copy, so that the replay keeps the signature without a key.
		HeaderAttempt: int32(1),
	}
}

// Truncate cuts s to at most n bytes without splitting a UTF-8 sequence,
// marking the cut with "…", and replaces invalid bytes, so that the header
// is always a valid string.
func Truncate(s string, n int) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	if len(s) <= n {
		return s
	}
	cut := n
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
}
