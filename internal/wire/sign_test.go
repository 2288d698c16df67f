package header_test

import (
	"maps"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/header"
)

var (
	k1 = header.Key{Secret: []byte("0123456789abcdef-key-one")}
	k2 = header.Key{Secret: []byte("0123456789abcdef-key-two")}
)

// signedCopy is a retry copy as idemq writes it, signed with ks.
func signedCopy(ks header.Keys) amqp.Table {
	h := amqp.Table{
		"x-custom":                header.Prefix + "looks-like-ours-but-is-a-value",
		header.Attempt:            int32(3),
		header.Tenant:             "alice",
		header.FirstSeen:          "2026-11-30T12:00:00Z",
		header.OriginalExchange:   "orders",
		header.OriginalRoutingKey: "orders.created",
	}
	ks.Sign(h, "m-1", []byte("body"), time.Now())
	return h
}

func TestSignedCopyVerifies(t *testing.T) {
	ks := header.Keys{k1}
	h := signedCopy(ks)
	if !strings.HasPrefix(h[header.Signature].(string), "v1.") {
		t.Fatalf("signature %q", h[header.Signature])
	}
	if !ks.Verify(h, "m-1", []byte("body")) {
		t.Fatal("a signed copy does not verify")
	}
	// Headers the signature does not cover may change (the broker's x-death,
	// the dead-letter reason, the trace context).
	h["x-death"], h[header.Reason], h["traceparent"] = []any{}, "permanent_error", "00-…"
	if !ks.Verify(h, "m-1", []byte("body")) {
		t.Fatal("an unsigned header broke the signature")
	}
	// A copy without any signed header (first copy of a message with no
	// tenant) signs and verifies too.
	bare := amqp.Table{}
	ks.Sign(bare, "", nil, time.Now())
	if !ks.Verify(bare, "", nil) {
		t.Fatal("a copy without signed headers does not verify")
	}
}

func TestTamperedCopyDoesNotVerify(t *testing.T) {
	ks := header.Keys{k1}
	for name, tamper := range map[string]func(h amqp.Table) (id string, body []byte){
		"attempt changed":     func(h amqp.Table) (string, []byte) { h[header.Attempt] = int32(1); return "m-1", []byte("body") },
		"attempt as a string": func(h amqp.Table) (string, []byte) { h[header.Attempt] = "3"; return "m-1", []byte("body") },
		"attempt removed":     func(h amqp.Table) (string, []byte) { delete(h, header.Attempt); return "m-1", []byte("body") },
		"tenant changed":      func(h amqp.Table) (string, []byte) { h[header.Tenant] = "mallory"; return "m-1", []byte("body") },
		"tenant as bytes":     func(h amqp.Table) (string, []byte) { h[header.Tenant] = []byte("alice"); return "m-1", []byte("body") },
		"tenant removed":      func(h amqp.Table) (string, []byte) { delete(h, header.Tenant); return "m-1", []byte("body") },
		"routing key changed": func(h amqp.Table) (string, []byte) {
			h[header.OriginalRoutingKey] = "admin"
			return "m-1", []byte("body")
		},
		"exchange changed": func(h amqp.Table) (string, []byte) { h[header.OriginalExchange] = ""; return "m-1", []byte("body") },
		"first seen changed": func(h amqp.Table) (string, []byte) {
			h[header.FirstSeen] = "2020-01-01T00:00:00Z"
			return "m-1", []byte("body")
		},
		"other message_id":  func(amqp.Table) (string, []byte) { return "m-2", []byte("body") },
		"other body":        func(amqp.Table) (string, []byte) { return "m-1", []byte("bodz") },
		"signature removed": func(h amqp.Table) (string, []byte) { delete(h, header.Signature); return "m-1", []byte("body") },
		"signature garbage": func(h amqp.Table) (string, []byte) { h[header.Signature] = "v1.!!"; return "m-1", []byte("body") },
		"signature truncated": func(h amqp.Table) (string, []byte) {
			h[header.Signature] = h[header.Signature].(string)[:20]
			return "m-1", []byte("body")
		},
		"signature as bytes": func(h amqp.Table) (string, []byte) {
			h[header.Signature] = []byte(h[header.Signature].(string))
			return "m-1", []byte("body")
		},
		"signature unversioned": func(h amqp.Table) (string, []byte) {
			h[header.Signature] = strings.TrimPrefix(h[header.Signature].(string), "v1.")
			return "m-1", []byte("body")
		},
		// Moving a value between fields keeps the bytes, not the encoding.
		"values swapped": func(h amqp.Table) (string, []byte) {
			h[header.OriginalExchange], h[header.OriginalRoutingKey] = h[header.OriginalRoutingKey], h[header.OriginalExchange]
			return "m-1", []byte("body")
		},
	} {
		t.Run(name, func(t *testing.T) {
			h := signedCopy(ks)
			id, body := tamper(h)
			if ks.Verify(h, id, body) {
				t.Fatal("a tampered copy verifies")
			}
		})
	}
}

func TestKeyRotation(t *testing.T) {
	old := signedCopy(header.Keys{k1})
	if (header.Keys{k2}).Verify(old, "m-1", []byte("body")) {
		t.Fatal("a copy signed with another key verifies")
	}
	// During a rotation every key verifies, whichever signed.
	both := header.Keys{k2, k1}
	if !both.Verify(old, "m-1", []byte("body")) || !both.Verify(signedCopy(both), "m-1", []byte("body")) {
		t.Fatal("a key of the list does not verify")
	}
	if !(header.Keys{k2}).Verify(signedCopy(both), "m-1", []byte("body")) {
		t.Fatal("the first key does not sign")
	}
	// A key that signs only from tomorrow verifies today, and the next key signs.
	tomorrow := header.Key{Secret: k2.Secret, SignsFrom: time.Now().Add(24 * time.Hour)}
	staged := header.Keys{tomorrow, k1}
	h := signedCopy(staged)
	if !(header.Keys{k1}).Verify(h, "m-1", []byte("body")) {
		t.Fatal("a key not yet due signed")
	}
	withNew := signedCopy(header.Keys{k2})
	if !staged.Verify(withNew, "m-1", []byte("body")) {
		t.Fatal("a key not yet due does not verify")
	}
}

func TestSignRefusesHeadersIdemqDoesNotWrite(t *testing.T) {
	ks := header.Keys{k1}
	h := amqp.Table{header.Attempt: int64(2), header.Signature: "v1.stale"}
	ks.Sign(h, "m", nil, time.Now())
	if _, ok := h[header.Signature]; ok || ks.Verify(h, "m", nil) {
		t.Fatalf("signed a header of a type idemq does not write: %v", h)
	}
}

func TestValidate(t *testing.T) {
	if err := (header.Keys{k1, k2}).Validate(); err != nil {
		t.Fatal(err)
	}
	if err := (header.Keys{}).Validate(); err == nil {
		t.Fatal("no key: want an error")
	}
	err := (header.Keys{k1, {Secret: []byte("tiny-secret")}}).Validate()
	if err == nil || strings.Contains(err.Error(), "tiny") {
		t.Fatalf("short key: %v (the error must not quote it)", err)
	}
}

func TestStrip(t *testing.T) {
	h := amqp.Table{"x-custom": 1, header.Attempt: int32(9), "X-IDEMQ-TENANT": "mallory", header.Signature: "v1.x"}
	orig := maps.Clone(h)
	got := header.Strip(h)
	if len(got) != 1 || got["x-custom"] != 1 {
		t.Fatalf("Strip = %v", got)
	}
	if !maps.Equal(h, orig) {
		t.Fatal("Strip changed its argument")
	}
	clean := amqp.Table{"a": "b"}
	if got := header.Strip(clean); len(got) != 1 {
		t.Fatalf("Strip of a table without idemq headers = %v", got)
	}
	if header.Strip(nil) != nil {
		t.Fatal("Strip(nil) != nil")
	}
}
