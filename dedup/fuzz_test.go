package dedup_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"hash/fnv"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/idemq/idemq/dedup"
)

// The seed corpora of these targets are in testdata/fuzz and run with every
// go test; make fuzz explores further.

func FuzzValidateKey(f *testing.F) {
	for _, k := range []string{"order-42", "", "заказ-42", strings.Repeat("k", 255), strings.Repeat("k", 256),
		"a\xffb", "a\nb", "a\x00b", "a\u0085b", "a\u200bb", "\U0010FFFF", strings.Repeat("é", 128)} {
		f.Add(k)
	}
	f.Fuzz(func(t *testing.T, key string) {
		err := dedup.ValidateKey(key)
		var want error
		switch {
		case key == "":
			want = dedup.ErrKeyRequired
		case len(key) > dedup.MaxKeyLen, !utf8.ValidString(key), strings.ContainsFunc(key, unicode.IsControl):
			want = dedup.ErrKeyInvalid
		}
		if want == nil {
			if err != nil {
				t.Fatalf("ValidateKey(%q) = %v, want nil", key, err)
			}
			return
		}
		if !errors.Is(err, want) {
			t.Fatalf("ValidateKey(%q) = %v, want %v", key, err, want)
		}
		// The text is fixed words and numbers: never the key, always printable.
		msg := err.Error()
		if !utf8.ValidString(msg) || len(msg) > 80 {
			t.Fatalf("error text %q is not short valid UTF-8", msg)
		}
		if len(key) > 8 && strings.Contains(msg, key) {
			t.Fatalf("error text %q carries the key", msg)
		}
	})
}

// fingerprintFields are the fields FuzzJSONFieldsFingerprint selects: flat,
// nested and missing ones.
var fingerprintFields = []string{"amount", "currency", "payer.account", "items", "missing.field"}

func FuzzJSONFieldsFingerprint(f *testing.F) {
	for _, b := range []string{
		`{"amount":100,"currency":"EUR","payer":{"account":"A"},"note":"x"}`,
		`{"note":"y","payer":{"name":"n","account":"A"},"currency":"EUR","amount":100}`,
		`{"amount":1e3,"items":[1,{"b":2,"a":[true,null]}],"payer":"flat"}`,
		`{"amount":-0.0,"currency":"\u00e9\ud83d\ude00<&>","payer":{"account":{"z":1,"y":2}}}`,
		`{"amount":12345678901234567890123,"amount":1}`,
		`{}`, `[]`, `null`, `"s"`, `1`, ``, `{`, `{"a":1}}`, `{"a":1} x`, `{"a":1} {"b":2}`,
		"{\"a\":\"\xff\"}", ` { "amount" : 1 } `, `{"a":` + strings.Repeat("[", 200) + strings.Repeat("]", 200) + `}`,
	} {
		f.Add([]byte(b), uint64(1))
	}
	fp := dedup.JSONFieldsFingerprint(fingerprintFields...)
	f.Fuzz(func(t *testing.T, body []byte, seed uint64) {
		got, err := fp(body)
		if !json.Valid(body) {
			if !errors.Is(err, dedup.ErrFingerprint) {
				t.Fatalf("invalid JSON %q: err %v, want one wrapping ErrFingerprint", body, err)
			}
			return
		}
		var doc any
		dec := json.NewDecoder(bytes.NewReader(body))
		dec.UseNumber()
		if dec.Decode(&doc) != nil {
			t.Fatalf("json.Valid accepted %q but it does not decode", body)
		}
		if _, isObject := doc.(map[string]any); !isObject {
			if !errors.Is(err, dedup.ErrFingerprint) {
				t.Fatalf("JSON %q is not an object: err %v, want one wrapping ErrFingerprint", body, err)
			}
			return
		}
		if err != nil {
			t.Fatalf("fingerprint of the JSON object %q: %v", body, err)
		}
		// The same meaning written otherwise: keys shuffled, spaces added,
		// strings escaped differently.
		rng := rand.New(rand.NewPCG(seed, fnvSum(body)))
		var b bytes.Buffer
		reencode(&b, doc, rng)
		again, err := fp(b.Bytes())
		if err != nil {
			t.Fatalf("fingerprint of the re-encoded %q: %v", b.Bytes(), err)
		}
		if again != got {
			t.Fatalf("fingerprints differ:\n%q\n%q", body, b.Bytes())
		}
	})
}

func fnvSum(b []byte) uint64 {
	h := fnv.New64a()
	h.Write(b)
	return h.Sum64()
}

// reencode writes v as JSON with object keys in random order, random
// insignificant whitespace and randomly chosen string escapes. Numbers are
// written as they were (json.Number).
func reencode(b *bytes.Buffer, v any, rng *rand.Rand) {
	space := func() {
		for range rng.IntN(3) {
			b.WriteByte(" \t\n\r"[rng.IntN(4)])
		}
	}
	space()
	switch x := v.(type) {
	case map[string]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		rng.Shuffle(len(keys), func(i, j int) { keys[i], keys[j] = keys[j], keys[i] })
		b.WriteByte('{')
		for i, k := range keys {
			if i > 0 {
				b.WriteByte(',')
			}
			writeString(b, k, rng)
			space()
			b.WriteByte(':')
			reencode(b, x[k], rng)
		}
		space()
		b.WriteByte('}')
	case []any:
		b.WriteByte('[')
		for i, e := range x {
			if i > 0 {
				b.WriteByte(',')
			}
			reencode(b, e, rng)
		}
		space()
		b.WriteByte(']')
	case string:
		writeString(b, x, rng)
	case json.Number:
		b.WriteString(string(x))
	case bool:
		if x {
			b.WriteString("true")
		} else {
			b.WriteString("false")
		}
	case nil:
		b.WriteString("null")
	}
	space()
}

// writeString writes s as a JSON string, escaping some characters as \uXXXX
// that need no escape.
func writeString(b *bytes.Buffer, s string, rng *rand.Rand) {
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r < 0x20 || (r < 0x10000 && rng.IntN(4) == 0):
			const hex = "0123456789abcdef"
			b.WriteString(`\u`)
			for shift := 12; shift >= 0; shift -= 4 {
				b.WriteByte(hex[(r>>shift)&0xf])
			}
		case r >= 0x10000 && rng.IntN(4) == 0:
			r1, r2 := utf16Surrogates(r)
			b.WriteString(`\u` + hex4(r1) + `\u` + hex4(r2))
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
}

func utf16Surrogates(r rune) (rune, rune) {
	r -= 0x10000
	return 0xd800 + (r>>10)&0x3ff, 0xdc00 + r&0x3ff
}

func hex4(r rune) string {
	const hex = "0123456789abcdef"
	return string([]byte{hex[(r>>12)&0xf], hex[(r>>8)&0xf], hex[(r>>4)&0xf], hex[r&0xf]})
}
