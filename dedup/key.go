package dedup

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"unicode"
	"unicode/utf8"
)

// ValidateKey checks a key as it arrived from the publisher. An empty key
// wraps ErrKeyRequired; a key longer than MaxKeyLen bytes, not valid UTF-8,
// or containing control characters wraps ErrKeyInvalid. The error text never
// contains the key itself.
func ValidateKey(key string) error {
	if key == "" {
		return ErrKeyRequired
	}
	if len(key) > MaxKeyLen {
		return fmt.Errorf("%w: %d bytes, longer than %d", ErrKeyInvalid, len(key), MaxKeyLen)
	}
	if !utf8.ValidString(key) {
		return fmt.Errorf("%w: not valid UTF-8", ErrKeyInvalid)
	}
	for i, r := range key {
		if unicode.IsControl(r) {
			return fmt.Errorf("%w: control character at byte %d", ErrKeyInvalid, i)
		}
	}
	return nil
}

// KeyHash returns a short, stable hash of a scoped key for logs and span
// attributes, so that raw keys stay out of them. It identifies a key without
// revealing it.
func KeyHash(consumer, tenant, key string) string {
	sum := scopedSum(consumer, tenant, key, "")
	return hex.EncodeToString(sum[:6])
}

// DerivedKey returns a deterministic idempotency key for one step of one
// operation, to pass to an external system (a payment gateway) so that its own
// deduplication recognises a retry of that step. The same scope and step
// always give the same 40-character key; different steps give different keys.
func DerivedKey(consumer, tenant, key, step string) string {
	sum := scopedSum(consumer, tenant, key, step)
	return "idemq-" + hex.EncodeToString(sum[:17])
}

// scopedSum hashes the scope's parts with length prefixes, so that no two
// different tuples collide by concatenation.
func scopedSum(parts ...string) [32]byte {
	h := sha256.New()
	for _, p := range parts {
		fmt.Fprintf(h, "%d:%s;", len(p), p)
	}
	var out [32]byte
	h.Sum(out[:0])
	return out
}

// storedKey is the form of the key kept in the table: the key itself, or
// "sha256:<hex>" when keys are hashed.
func (s *Store) storedKey(key string) string {
	if !s.cfg.HashKeys {
		return key
	}
	sum := sha256.Sum256([]byte(key))
	return "sha256:" + hex.EncodeToString(sum[:])
}
