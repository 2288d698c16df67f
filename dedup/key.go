package dedup

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
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

// MaxTenantLen is the longest tenant accepted, in bytes, like a key.
const MaxTenantLen = 255

// ErrTenantInvalid means the tenant is longer than MaxTenantLen bytes, is
// not valid UTF-8, or contains control characters. The consumer
// dead-letters such a delivery with reason idempotency_key_invalid; the
// HTTP middleware (package idemhttp) answers 400 tenant_invalid.
var ErrTenantInvalid = errors.New("the tenant is invalid")

// ValidateTenant checks a tenant as it arrived (a header, the AMQP
// user_id, an HTTP request's principal): one rule for every door. The
// default tenant "" is valid; a tenant longer than MaxTenantLen bytes, not
// valid UTF-8, or containing control characters wraps ErrTenantInvalid. The
// error text never contains the tenant itself.
func ValidateTenant(tenant string) error {
	if len(tenant) > MaxTenantLen {
		return fmt.Errorf("%w: %d bytes, longer than %d", ErrTenantInvalid, len(tenant), MaxTenantLen)
	}
	if !utf8.ValidString(tenant) {
		return fmt.Errorf("%w: not valid UTF-8", ErrTenantInvalid)
	}
	for i, r := range tenant {
		if unicode.IsControl(r) {
			return fmt.Errorf("%w: control character at byte %d", ErrTenantInvalid, i)
		}
	}
	return nil
}

// Scope is what an idempotency key is unique within: the consumer (the
// stable name of the handler, so that two handlers of one message are two
// scopes), the tenant ("" is the default tenant) and the key itself, as the
// publisher sent it. One tenant never sees another's row.
type Scope struct {
	// Consumer is the stable name of the handler (the consumer's Config.Name).
	Consumer string
	// Tenant scopes the key further; "" is the default tenant.
	Tenant string
	// Key is the publisher's idempotency key, validated with ValidateKey. It
	// is always the raw key, also when the store keeps hashes (HashKeys).
	Key string
}

// KeyHash returns a short, stable hash of the scoped key for logs and span
// attributes, so that raw keys stay out of them. It identifies a key without
// revealing it.
func (s Scope) KeyHash() string {
	sum := scopedSum(s.Consumer, s.Tenant, s.Key, "")
	return hex.EncodeToString(sum[:6])
}

// DerivedKey returns a deterministic idempotency key for one step of the
// operation, to pass to an external system (a payment gateway) so that its
// own deduplication recognises a retry of that step. The same scope and step
// always give the same 40-character key; different steps give different keys.
func (s Scope) DerivedKey(step string) string {
	sum := scopedSum(s.Consumer, s.Tenant, s.Key, step)
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
