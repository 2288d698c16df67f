package wire

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// signed are the headers the signature covers, in the order they are encoded.
var signed = []string{HeaderAttempt, HeaderTenant, HeaderFirstSeen, HeaderOriginalExchange, HeaderOriginalRoutingKey}

// MinKeyLen is the shortest key accepted, in bytes.
const MinKeyLen = 16

const (
	// sigPrefix is the version of the signature: "v2." covers the binding
	// (queue and consumer) besides the headers. "v1." signatures, which did
	// not, verify no more: their copies are unsigned.
	sigPrefix = "v2."
	// domain separates these MACs from any other use of the keys, and from
	// the v1 ones.
	domain = "idemq-headers-v2"
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

	// binding is the encoded queue and consumer For bound the key to
	// ("": none).
	binding string
}

// Keys are a deployment's HMAC keys, newest first: the first key whose
// SignsFrom has passed signs, and every key verifies.
//
// A signature holds for one binding, the queue and consumer of For: keys a
// consumer bound to its work queue and name sign copies that only that
// consumer trusts. Keys not bound by For sign and verify for no queue:
// nothing a consumer signs verifies under them, and nothing they sign
// verifies at a consumer.
type Keys []Key

// For returns ks bound to the consumer named consumer of the work queue
// queue: they sign copies for it (its retry copies, which come back to queue
// from their tier, and its dead letters, which idemq dlq replay puts back
// into queue) and verify only copies signed for it. A copy signed for one
// stage and moved into another stage's queue, or read by a consumer of
// another name, is then unsigned there.
func (ks Keys) For(queue, consumer string) Keys {
	binding := string(appendString(appendString(nil, queue), consumer))
	out := make(Keys, len(ks))
	for i, k := range ks {
		k.binding = binding
		out[i] = k
	}
	return out
}

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
func (ks Keys) signer(now time.Time) Key {
	for _, k := range ks {
		if !k.SignsFrom.After(now) {
			return k
		}
	}
	return ks[len(ks)-1]
}

// Sign sets h's Signature over the binding of the keys (For), the signed
// headers of h, messageID and body. If a signed header has a type idemq does
// not write, or there is no key, it removes the signature instead: the copy
// is then unsigned.
func (ks Keys) Sign(h amqp.Table, messageID string, body []byte, now time.Time) {
	if len(ks) == 0 {
		delete(h, HeaderSignature)
		return
	}
	k := ks.signer(now)
	sum := sha256.Sum256(body)
	msg, ok := canonical(k.binding, h, messageID, sum)
	if !ok {
		delete(h, HeaderSignature)
		return
	}
	h[HeaderSignature] = sigPrefix + base64.RawURLEncoding.EncodeToString(mac(k.Secret, msg))
}

// Verify reports whether h carries a valid signature, under any of the
// keys, for their binding (For), over its signed headers, messageID and
// body. The MACs are compared in constant time. A v1 signature, made before
// signatures had a binding, is not valid.
func (ks Keys) Verify(h amqp.Table, messageID string, body []byte) bool {
	s, ok := h[HeaderSignature].(string)
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
	sum := sha256.Sum256(body)
	var msg []byte
	valid := false
	for i, k := range ks {
		if i == 0 || k.binding != ks[i-1].binding {
			if msg, ok = canonical(k.binding, h, messageID, sum); !ok {
				return false
			}
		}
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

// canonical encodes what the signature covers: a domain tag, the binding
// (the queue and the consumer, themselves length-prefixed; empty for keys
// not bound), the message_id, the body's SHA-256 (sum), then each signed
// header's name and value (absent, a string, or an int32), every variable
// part length-prefixed so that no two different inputs encode alike. ok is
// false for a signed header of another type.
func canonical(binding string, h amqp.Table, messageID string, sum [sha256.Size]byte) (b []byte, ok bool) {
	b = make([]byte, 0, 256+len(binding))
	b = append(b, domain...)
	b = appendString(b, binding)
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
