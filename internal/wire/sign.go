// Package header names idemq's own message headers (x-idemq-*) and proves
// which of them idemq wrote.
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
package header

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Prefix starts the name of every idemq header.
const Prefix = "x-idemq-"

// Names of idemq's headers.
const (
	// Attempt is the attempt number of a retry copy (int32, 1 on a dead letter).
	Attempt = Prefix + "attempt"
	// Tenant is the tenant the first attempt resolved, carried so that later
	// attempts use the same key scope (the copy has no user_id).
	Tenant = Prefix + "tenant"
	// FirstSeen is when idemq first saw the message (RFC 3339).
	FirstSeen = Prefix + "first-seen"
	// OriginalExchange and OriginalRoutingKey say where the message was first published.
	OriginalExchange   = Prefix + "original-exchange"
	OriginalRoutingKey = Prefix + "original-routing-key"
	// Reason, Error and Attempts describe a dead letter (not signed: nothing
	// acts on them).
	Reason   = Prefix + "reason"
	Error    = Prefix + "error"
	Attempts = Prefix + "attempts"
	// Outcome and ResponseCode describe the stored result on a reply sent
	// to reply_to (not signed: a reply is for its requester).
	Outcome      = Prefix + "outcome"
	ResponseCode = Prefix + "response-code"
	// Signature proves that idemq wrote the signed headers: "v1." and the
	// unpadded base64url HMAC-SHA256.
	Signature = Prefix + "signature"
)

// signed are the headers the signature covers, in the order they are encoded.
var signed = []string{Attempt, Tenant, FirstSeen, OriginalExchange, OriginalRoutingKey}

// MinKeyLen is the shortest key accepted, in bytes.
const MinKeyLen = 16

const (
	sigPrefix = "v1."
	// domain separates these MACs from any other use of the keys.
	domain = "idemq-headers-v1"
)

// Key is one HMAC key.
type Key struct {
	// Secret is the key itself, at least MinKeyLen random bytes. It never
	// appears in logs.
	Secret []byte
	// SignsFrom is when the key starts signing (zero: at once). It verifies
	// at once, so that a key can be rolled out to every worker before any
	// worker signs with it.
	SignsFrom time.Time
}

// Keys are a deployment's HMAC keys, newest first: the first key whose
// SignsFrom has passed signs, and every key verifies.
type Keys []Key

// Validate reports an empty list or a key shorter than MinKeyLen.
func (ks Keys) Validate() error {
	if len(ks) == 0 {
		return errors.New("no header key")
	}
	for i, k := range ks {
		if len(k.Secret) < MinKeyLen {
			return fmt.Errorf("header key %d is %d bytes, shorter than %d", i+1, len(k.Secret), MinKeyLen)
		}
	}
	return nil
}

// signer is the key that signs at now: the first whose SignsFrom has
// passed, else (every key is still to come) the last one.
func (ks Keys) signer(now time.Time) []byte {
	for _, k := range ks {
		if !k.SignsFrom.After(now) {
			return k.Secret
		}
	}
	return ks[len(ks)-1].Secret
}

// Sign sets h's Signature over the signed headers of h, messageID and body.
// If a signed header has a type idemq does not write, or there is no key,
// it removes the signature instead: the copy is then unsigned.
func (ks Keys) Sign(h amqp.Table, messageID string, body []byte, now time.Time) {
	msg, ok := canonical(h, messageID, body)
	if !ok || len(ks) == 0 {
		delete(h, Signature)
		return
	}
	h[Signature] = sigPrefix + base64.RawURLEncoding.EncodeToString(mac(ks.signer(now), msg))
}

// Verify reports whether h carries a valid signature, under any of the
// keys, over its signed headers, messageID and body. The MACs are compared
// in constant time.
func (ks Keys) Verify(h amqp.Table, messageID string, body []byte) bool {
	s, ok := h[Signature].(string)
	if !ok {
		return false
	}
	enc, found := strings.CutPrefix(s, sigPrefix)
	if !found {
		return false
	}
	got, err := base64.RawURLEncoding.DecodeString(enc)
	if err != nil || len(got) != sha256.Size {
		return false
	}
	msg, ok := canonical(h, messageID, body)
	if !ok {
		return false
	}
	valid := false
	for _, k := range ks {
		if hmac.Equal(mac(k.Secret, msg), got) {
			valid = true
		}
	}
	return valid
}

func mac(key, msg []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write(msg)
	return m.Sum(nil)
}

// canonical encodes what the signature covers: a domain tag, the
// message_id, the body's SHA-256, then each signed header's name and value
// (absent, a string, or an int32), every variable part length-prefixed so
// that no two different inputs encode alike. ok is false for a signed header
// of another type.
func canonical(h amqp.Table, messageID string, body []byte) (b []byte, ok bool) {
	sum := sha256.Sum256(body)
	b = make([]byte, 0, 256)
	b = append(b, domain...)
	b = appendString(b, messageID)
	b = append(b, sum[:]...)
	for _, name := range signed {
		b = appendString(b, name)
		v, present := h[name]
		switch v := v.(type) {
		case string:
			b = appendString(append(b, 's'), v)
		case int32:
			b = binary.BigEndian.AppendUint32(append(b, 'i'), uint32(v))
		default:
			if present {
				return nil, false
			}
			b = append(b, '-')
		}
	}
	return b, true
}

func appendString(b []byte, s string) []byte {
	return append(binary.AppendUvarint(b, uint64(len(s))), s...)
}

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
