package wire

import (
	"maps"
	"strings"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Prefix starts the name of every idemq header.
const Prefix = "x-idemq-"

// Names of idemq's headers.
const (
	// HeaderAttempt is the attempt number of a retry copy (int32, 1 on a
	// dead letter).
	HeaderAttempt = Prefix + "attempt"
	// HeaderTenant is the tenant the first attempt resolved, carried so that
	// later attempts use the same key scope (the copy has no user_id).
	HeaderTenant = Prefix + "tenant"
	// HeaderFirstSeen is when idemq first saw the message (RFC 3339).
	HeaderFirstSeen = Prefix + "first-seen"
	// HeaderOriginalExchange and HeaderOriginalRoutingKey say where the
	// message was first published.
	HeaderOriginalExchange   = Prefix + "original-exchange"
	HeaderOriginalRoutingKey = Prefix + "original-routing-key"
	// HeaderReason, HeaderError and HeaderAttempts describe a dead letter
	// (not signed: nothing acts on them).
	HeaderReason   = Prefix + "reason"
	HeaderError    = Prefix + "error"
	HeaderAttempts = Prefix + "attempts"
	// HeaderOutcome, HeaderResponseCode and HeaderResponseReason describe
	// the stored result on a reply sent to reply_to (not signed: a reply is
	// for its requester). The reason is on rejections only.
	HeaderOutcome        = Prefix + "outcome"
	HeaderResponseCode   = Prefix + "response-code"
	HeaderResponseReason = Prefix + "response-reason"
	// HeaderWaitingSince is when an ordered message was first found early
	// (RFC 3339), on the copy that sends it round a retry tier while the
	// waiting room is full: its gap timeout counts from then. Not signed,
	// and read only from a signed copy (the others lose their x-idemq-*);
	// no other copy keeps it.
	HeaderWaitingSince = Prefix + "waiting-since"
	// HeaderSignature proves that idemq wrote the signed headers for the
	// queue and consumer that read them (Keys.For): "v2." and the unpadded
	// base64url HMAC-SHA256.
	HeaderSignature = Prefix + "signature"
)

// Names of the headers the broker writes and idemq reads.
const (
	// HeaderDeath lists, newest first, each time the broker dead-lettered
	// the message: a table with its reason, queue, exchange, routing-keys
	// and count.
	HeaderDeath = "x-death"
	// FirstDeathPrefix and LastDeathPrefix start the names of the headers
	// that sum up the first and the latest x-death entry (…-reason,
	// …-queue, …-exchange).
	FirstDeathPrefix = "x-first-death-"
	LastDeathPrefix  = "x-last-death-"
	// HeaderDeliveryCount is a quorum queue's count of earlier deliveries.
	HeaderDeliveryCount = "x-delivery-count"
)

// Names of the W3C trace context headers.
const (
	HeaderTraceparent = "traceparent"
	HeaderTracestate  = "tracestate"
)

// IsIdemq reports whether name is one of idemq's headers (x-idemq-*, in
// any case).
func IsIdemq(name string) bool {
	return len(name) >= len(Prefix) && strings.EqualFold(name[:len(Prefix)], Prefix)
}

// Strip returns h without idemq's headers: h itself when it has none, else
// a copy (h is left as it is).
func Strip(h amqp.Table) amqp.Table {
	out, copied := h, false
	for name := range h {
		if !IsIdemq(name) {
			continue
		}
		if !copied {
			out, copied = maps.Clone(h), true
		}
		delete(out, name)
	}
	return out
}
