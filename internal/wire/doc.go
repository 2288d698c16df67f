// Package wire owns idemq's message format on RabbitMQ, in one place: the
// names of idemq's headers (x-idemq-*) and of the broker's headers it reads
// (x-death, x-delivery-count), the copies idemq publishes of a delivery, the
// headers those copies carry, and how every one of them is read back.
//
// The format is a contract with the messages already in a deployment's
// queues: a retry copy waiting in a tier or a dead letter in a DLQ was
// written by an earlier version and must still be read. Header names, value
// types and values do not change.
//
// # Copies
//
// A delivery leaves a work queue in one of four copies, each made here:
//
//   - Copy: the retry copy (to a delay tier, RetryHeaders) or the dead letter
//     (to the DLQ, DeadLetterHeaders) that replaces it, written by the
//     consumer: body, properties and headers kept, the original exchange,
//     routing key and first-seen time added, and signed.
//   - ReplayCopy: a dead letter moved back to its work queue (idemq dlq
//     replay): the dead-letter description dropped, the signed headers kept
//     as they are, so that the signature still verifies without a key.
//   - ForwardHeaders: the headers of a message a forwarding stage passes on
//     (idemq forward): those that describe the message, not its path through
//     the stage.
//   - Fit and TooLarge: a copy trimmed to fit in one frame, and the dead
//     letter of one that cannot.
//
// # Reading
//
// Value reads a header value of any AMQP type as a string or an integer,
// for every reader here: ParseAttempt (x-idemq-attempt), ReadKey and ReadTenant (the
// idempotency key and the tenant of a delivery), and ReadLetter (what a dead
// letter says: the reason, attempts, error, origin, or the broker's x-death).
//
// # The signature
//
// Anyone who may publish to a work queue can write any header, so idemq
// trusts the headers that steer it (the attempt number, the tenant carried
// for TenantFromUserID, the original exchange and routing key, the first-seen
// time) only on a copy that carries a valid signature: an HMAC-SHA256, under
// one of the deployment's keys, of a canonical encoding of those headers, the
// message_id and a SHA-256 of the body. On any other delivery they are
// stripped (Strip) before anything reads, forwards or copies them.
//
// The signed headers must have the types idemq writes: strings, and int32
// for the attempt. A header of another type makes the signature invalid.
package wire
