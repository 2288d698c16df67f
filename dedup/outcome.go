package dedup

// Outcome is the one vocabulary of how an operation ended, shared by every
// door onto the protocol: the outcome a Result stores (OutcomeOK,
// OutcomeRejected), the idemq.outcome attribute of a consumer's and of an
// HTTP request's span, the outcome label of their counters, and
// consumer.Event.Outcome. Where the situation is the same, a delivery and
// a request have the same word (DESIGN section 4).
type Outcome string

// The outcomes a Result stores: Complete accepts these two only.
const (
	// OutcomeOK is a successful operation (reported as OutcomeProcessed).
	OutcomeOK Outcome = "ok"
	// OutcomeRejected is a business rejection: a result, kept and replayed.
	OutcomeRejected Outcome = "rejected"
)

// The outcomes of one delivery or request, beside OutcomeRejected.
const (
	// OutcomeProcessed: the handler ran and its result is stored.
	OutcomeProcessed Outcome = "processed"
	// OutcomeDuplicate: answered from the stored result; nothing ran.
	OutcomeDuplicate Outcome = "duplicate"
	// OutcomeInProgress: another worker or request holds the key's lease
	// (a delivery is retried later, a request answered 409).
	OutcomeInProgress Outcome = "in_progress"
	// OutcomeKeyReuse: the key names another operation (its fingerprint
	// differs).
	OutcomeKeyReuse Outcome = "key_reuse"
	// OutcomeInvalidKey: no key, or not a valid one.
	OutcomeInvalidKey Outcome = "invalid_key"
	// OutcomeLeaseLost: the lease went to another owner before the result
	// was committed; the work was rolled back.
	OutcomeLeaseLost Outcome = "lease_lost"

	// OutcomeRetried: an infrastructure failure released the key and the
	// delivery went to a retry tier (consumer only).
	OutcomeRetried Outcome = "retried"
	// OutcomeDeadLettered: the delivery went to the DLQ with a reason
	// (consumer only).
	OutcomeDeadLettered Outcome = "dead_lettered"
	// OutcomeWaiting: an ordered delivery came before a sequence of its
	// key not applied yet; it waits, unacknowledged and not run, for it
	// (consumer only, docs/ordering.md).
	OutcomeWaiting Outcome = "waiting"
	// OutcomeCopyFailed: the copy that was to replace the delivery (retry,
	// dead letter) was not confirmed durable, so the delivery went back to
	// its queue unacknowledged and will come again (consumer only).
	OutcomeCopyFailed Outcome = "copy_failed"

	// OutcomeNotStored: the handler ran but its response is no result
	// (idemhttp's Config.Stored, Discard): rolled back, the key released.
	OutcomeNotStored Outcome = "not_stored"
	// OutcomeRefused: the request was refused before its key was reserved
	// (its body, its tenant, its credentials).
	OutcomeRefused Outcome = "refused"
	// OutcomeFailed: an infrastructure failure, a timeout or a panic: the
	// key was released, and a retry runs again (what a delivery reports as
	// OutcomeRetried or OutcomeDeadLettered).
	OutcomeFailed Outcome = "failed"
)

// Stored reports whether o is an outcome a Result can store.
func (o Outcome) Stored() bool { return o == OutcomeOK || o == OutcomeRejected }
