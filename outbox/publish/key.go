package publish

import "github.com/google/uuid"

// NewKey returns a new random idempotency key: a UUID (version 7, so that
// keys made together sit together in the key table's index) as 36
// characters of text.
//
// Make the key once per operation, before its first publish, and keep it
// with the operation (in the request being served, the job's row, a local
// variable around the retry loop): every retry of that operation, by
// Publish or by the caller, sends the same key, which is how the consumer
// recognises it. Never derive a key from the body (two identical purchases
// are two operations) and never put personal data in one (keys are stored
// and shown to operators).
func NewKey() string {
	id, err := uuid.NewV7()
	if err != nil {
		// The clock or the random source failed; a random key is as unique.
		return uuid.NewString()
	}
	return id.String()
}
