// Package publish is the outbox's sibling for code that publishes outside a
// database transaction: a confirmed publisher that sets the message's
// message_id to the operation's idempotency key and retries until the
// broker has the message, always with that same id.
//
// Code that writes to Postgres in the same operation should use the outbox
// (package github.com/idemq/idemq/outbox) instead: there the message exists
// if and only if the transaction commits. A Publisher gives no such
// guarantee about anything but the message; it makes sure that a message it
// reports as published is in a queue, and that every copy it may have sent
// carries the same key, so that a consumer deduplicating on message_id (see
// package github.com/idemq/idemq/consumer) applies the operation once.
//
// # Publishing
//
// New returns a Publisher for a broker URL; it connects on first use and
// reconnects whenever the connection is lost. Publish(ctx, key, msg) sends
// msg as a persistent, mandatory publish on a channel in confirm mode, with
// message_id = key, and returns nil only once the broker confirmed it and
// did not return it. A lost connection, a closed channel, a confirm that
// does not come in time and a nack are retried with exponential backoff
// (cenkalti/backoff), with the same message id, until ctx ends. A message
// no queue takes is ErrUnroutable, a message too large for one frame is
// ErrTooLarge: neither is retried. Errors and logs never contain the broker
// URL's credentials or the key. Each Publish is one producer span, whose
// context travels in the message's traceparent header.
//
// # Keys
//
// The key is the operation's, not the attempt's: make it once, before the
// first publish (NewKey makes a random one), keep it with the operation and
// reuse it on every retry, including retries of the caller's own. A key is
// never a hash of the body (two identical purchases are two operations) and
// never carries personal data. Keys are validated as the consumer validates
// them (dedup.ValidateKey): an empty key or an invalid one is refused before
// anything is sent.
package publish
