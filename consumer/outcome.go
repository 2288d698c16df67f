package consumer

import "time"

// Outcome is what happened to one delivery: the value of the span attribute
// idemq.outcome and of the metric label.
type Outcome string

// The outcomes of DESIGN section 4.
const (
	OutcomeProcessed    Outcome = "processed"
	OutcomeRejected     Outcome = "rejected"
	OutcomeDeadLettered Outcome = "dead_lettered"
	OutcomeRetried      Outcome = "retried"
	OutcomeLeaseLost    Outcome = "lease_lost"
	OutcomeDuplicate    Outcome = "duplicate"
	OutcomeInProgress   Outcome = "in_progress"
	OutcomeKeyReuse     Outcome = "key_reuse"
	OutcomeInvalidKey   Outcome = "invalid_key"
)

// Reason words carried by dead letters in header x-idemq-reason.
const (
	ReasonPermanentError      = "permanent_error"
	ReasonMaxAttemptsExceeded = "max_attempts_exceeded"
	ReasonKeyRequired         = "idempotency_key_required"
	ReasonKeyInvalid          = "idempotency_key_invalid"
	ReasonKeyReuse            = "idempotency_key_reuse"
)

// Event reports the end of one delivery to Config.OnOutcome.
type Event struct {
	Outcome Outcome
	// Reason is the dead-letter reason, for dead letters.
	Reason string
	// KeyHash is a short hash of the scoped key (never the raw key).
	KeyHash string
	Tenant  string
	Attempt int
	// Err is the failure behind retries and dead letters.
	Err error
	// TraceID is the trace of this delivery's process span (hex); for a
	// duplicate, OriginalTraceID is the trace of the processing it duplicated.
	TraceID, OriginalTraceID string
	// Duration is the time from delivery to ack.
	Duration time.Duration

	// scoped: Tenant was resolved (the key's scope is known); the copies of
	// the delivery carry it.
	scoped bool
}
