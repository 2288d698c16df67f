package dedup

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"strings"
)

// Fingerprint is the SHA-256 of an operation's significant content. Two
// deliveries with the same key and fingerprint are the same operation; the
// same key with another fingerprint is a reused key.
type Fingerprint [32]byte

// String returns the fingerprint in hex.
func (f Fingerprint) String() string { return hex.EncodeToString(f[:]) }

// Fingerprinter computes the fingerprint of a message body.
type Fingerprinter func(body []byte) (Fingerprint, error)

// BodyFingerprint fingerprints the whole body, byte for byte. It is the default.
func BodyFingerprint(body []byte) (Fingerprint, error) {
	return sha256.Sum256(body), nil
}

// JSONFieldsFingerprint returns a Fingerprinter over the named fields of a
// JSON object body, canonicalised (sorted keys, no insignificant spaces,
// numbers as written), so that a changed comment or metadata field does not
// turn a legal retry into key reuse. A field name may be a dotted path into
// nested objects ("payer.account"). A missing field counts as null. A body that
// is not a JSON object gives an error wrapping ErrFingerprint.
func JSONFieldsFingerprint(fields ...string) Fingerprinter {
	paths := make([][]string, len(fields))
	for i, f := range fields {
		paths[i] = strings.Split(f, ".")
	}
	return func(body []byte) (Fingerprint, error) {
		canonical, err := CanonicalJSONFields(body, paths)
		if err != nil {
			return Fingerprint{}, err
		}
		return sha256.Sum256(canonical), nil
	}
}

// CanonicalJSONFields returns the canonical encoding of the selected fields
// of a JSON object: a JSON object from each path (joined with ".") to its
// canonical value.
func CanonicalJSONFields(body []byte, paths [][]string) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var doc any
	if err := dec.Decode(&doc); err != nil {
		return nil, fmt.Errorf("%w: body is not JSON: %v", ErrFingerprint, err)
	}
	// Only spaces may follow the value. (Decoder.More is no test of that:
	// it reports false before a stray '}' or ']'.)
	if _, err := dec.Token(); err != io.EOF {
		return nil, fmt.Errorf("%w: body holds more than one JSON value", ErrFingerprint)
	}
	if _, ok := doc.(map[string]any); !ok {
		return nil, fmt.Errorf("%w: body is not a JSON object", ErrFingerprint)
	}
	selected := make(map[string]any, len(paths))
	for _, path := range paths {
		selected[strings.Join(path, ".")] = lookup(doc, path)
	}
	// encoding/json writes map keys sorted and no spaces; json.Number keeps
	// the digits as written.
	out, err := json.Marshal(selected)
	if err != nil {
		return nil, fmt.Errorf("%w: encode: %v", ErrFingerprint, err)
	}
	return out, nil
}

func lookup(v any, path []string) any {
	for _, p := range path {
		obj, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = obj[p]
	}
	return v
}
