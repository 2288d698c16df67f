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
		delete(h, HeaderSignature)
		return
	}
	h[HeaderSignature] = sigPrefix + base64.RawURLEncoding.EncodeToString(mac(ks.signer(now), msg))
}

// Verify reports whether h carries a valid signature, under any of the
// keys, over its signed headers, messageID and body. The MACs are compared
// in constant time.
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
