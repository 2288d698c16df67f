package consumer

import (
	"time"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/confirm"
)

// Outcome is what happened to one delivery: the value of the span attribute
// idemq.outcome and of the metric label. It is the protocol's one outcome
// vocabulary, dedup.Outcome, which idemhttp's requests share.
type Outcome = dedup.Outcome

// The outcomes of DESIGN section 4, and OutcomeCopyFailed.
const (
	OutcomeProcessed    = dedup.OutcomeProcessed
	OutcomeRejected     = dedup.OutcomeRejected
	OutcomeDeadLettered = dedup.OutcomeDeadLettered
	OutcomeRetried      = dedup.OutcomeRetried
	OutcomeLeaseLost    = dedup.OutcomeLeaseLost
	OutcomeDuplicate    = dedup.OutcomeDuplicate
	OutcomeInProgress   = dedup.OutcomeInProgress
	OutcomeKeyReuse     = dedup.OutcomeKeyReuse
	OutcomeInvalidKey   = dedup.OutcomeInvalidKey
	// OutcomeCopyFailed: the copy that was to replace the delivery (retry,
	// dead letter) was not confirmed durable (returned as unroutable,
	// nacked, not confirmed in time, channel closed), so the delivery went
	// back to its queue unacknowledged and will come again. Event.Err says
	// what failed.
	OutcomeCopyFailed = dedup.OutcomeCopyFailed
)

// Event reports the end of one delivery to Config.OnOutcome.
type Event struct {
	Outcome Outcome
	// Reason is the dead-letter reason (a Reason* word), for dead letters.
	Reason string
	// RejectReason is the reason the handler gave to Reject, for a
	// rejection and for a duplicate of one (which receives the stored
	// rejection).
	RejectReason string
	// KeyHash is a short hash of the scoped key (never the raw key).
	KeyHash string
	Tenant  string
	Attempt int
	// Err is the failure behind retries and dead letters.
	Err error
	// TraceID is the trace of this delivery's process span (hex); for a
	// duplicate, OriginalTraceID is the trace of the processing it duplicated.
	TraceID, OriginalTraceID string
	// ReplyErr is set when the stored result could not be delivered to the
	// message's reply_to (the reply was returned, refused or not confirmed).
	// The delivery itself is settled; a requester that resends gets the
	// stored result again.
	ReplyErr error
	// Duration is the time from delivery to ack.
	Duration time.Duration

	// scoped: Tenant was resolved (the key's scope is known); the copies of
	// the delivery carry it.
	scoped bool
}

// Errors that Event.Err wraps when the copy that was to replace a delivery
// did not become durable (OutcomeCopyFailed). Test them with errors.Is.
var (
	// ErrUnroutable: the broker returned the copy; no queue took it (a
	// retry tier or the DLQ missing or unbound).
	ErrUnroutable = confirm.ErrUnroutable
	// ErrNacked: the broker refused the copy.
	ErrNacked = confirm.ErrNacked
	// ErrChannelClosed: the publishing channel closed before the broker
	// confirmed the copy.
	ErrChannelClosed = confirm.ErrClosed
	// ErrTooLarge: the copy's headers would not fit the connection's
	// frame_max.
	ErrTooLarge = confirm.ErrTooLarge
)
