package wire_test

import (
	"maps"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/wire"
)

var (
	k1 = wire.Key{Secret: []byte("0123456789abcdef-key-one")}
	k2 = wire.Key{Secret: []byte("0123456789abcdef-key-two")}
)

// signedCopy is a retry copy as idemq writes it, signed with ks.
func signedCopy(ks wire.Keys) amqp.Table {
	h := amqp.Table{
		"x-custom":                    wire.Prefix + "looks-like-ours-but-is-a-value",
		wire.HeaderAttempt:            int32(3),
		wire.HeaderTenant:             "alice",
		wire.HeaderFirstSeen:          "2026-11-30T12:00:00Z",
		wire.HeaderOriginalExchange:   "orders",
		wire.HeaderOriginalRoutingKey: "orders.created",
	}
	ks.Sign(h, "m-1", []byte("body"), time.Now())
	return h
}

func TestSignedCopyVerifies(t *testing.T) {
	ks := wire.Keys{k1}
	h := signedCopy(ks)
	if !strings.HasPrefix(h[wire.HeaderSignature].(string), "v2.") {
		t.Fatalf("signature %q", h[wire.HeaderSignature])
	}
	if !ks.Verify(h, "m-1", []byte("body")) {
		t.Fatal("a signed copy does not verify")
	}
	// Headers the signature does not cover may change (the broker's x-death,
	// the dead-letter reason, the trace context).
	h["x-death"], h[wire.HeaderReason], h["traceparent"] = []any{}, "permanent_error", "00-…"
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
	ks := wire.Keys{k1}
	for name, tamper := range map[string]func(h amqp.Table) (id string, body []byte){
		"attempt changed":     func(h amqp.Table) (string, []byte) { h[wire.HeaderAttempt] = int32(1); return "m-1", []byte("body") },
		"attempt as a string": func(h amqp.Table) (string, []byte) { h[wire.HeaderAttempt] = "3"; return "m-1", []byte("body") },
		"attempt removed":     func(h amqp.Table) (string, []byte) { delete(h, wire.HeaderAttempt); return "m-1", []byte("body") },
		"tenant changed":      func(h amqp.Table) (string, []byte) { h[wire.HeaderTenant] = "mallory"; return "m-1", []byte("body") },
		"tenant as bytes": func(h amqp.Table) (string, []byte) {
			h[wire.HeaderTenant] = []byte("alice")
			return "m-1", []byte("body")
		},
		"tenant removed": func(h amqp.Table) (string, []byte) { delete(h, wire.HeaderTenant); return "m-1", []byte("body") },
		"routing key changed": func(h amqp.Table) (string, []byte) {
			h[wire.HeaderOriginalRoutingKey] = "admin"
			return "m-1", []byte("body")
		},
		"exchange changed": func(h amqp.Table) (string, []byte) { h[wire.HeaderOriginalExchange] = ""; return "m-1", []byte("body") },
		"first seen changed": func(h amqp.Table) (string, []byte) {
			h[wire.HeaderFirstSeen] = "2020-01-01T00:00:00Z"
			return "m-1", []byte("body")
		},
		"other message_id":  func(amqp.Table) (string, []byte) { return "m-2", []byte("body") },
		"other body":        func(amqp.Table) (string, []byte) { return "m-1", []byte("bodz") },
		"signature removed": func(h amqp.Table) (string, []byte) { delete(h, wire.HeaderSignature); return "m-1", []byte("body") },
		"signature garbage": func(h amqp.Table) (string, []byte) { h[wire.HeaderSignature] = "v1.!!"; return "m-1", []byte("body") },
		"signature truncated": func(h amqp.Table) (string, []byte) {
			h[wire.HeaderSignature] = h[wire.HeaderSignature].(string)[:20]
			return "m-1", []byte("body")
		},
		"signature as bytes": func(h amqp.Table) (string, []byte) {
			h[wire.HeaderSignature] = []byte(h[wire.HeaderSignature].(string))
			return "m-1", []byte("body")
		},
		"signature unversioned": func(h amqp.Table) (string, []byte) {
			h[wire.HeaderSignature] = strings.TrimPrefix(h[wire.HeaderSignature].(string), "v2.")
			return "m-1", []byte("body")
		},
		// Moving a value between fields keeps the bytes, not the encoding.
		"values swapped": func(h amqp.Table) (string, []byte) {
			h[wire.HeaderOriginalExchange], h[wire.HeaderOriginalRoutingKey] = h[wire.HeaderOriginalRoutingKey], h[wire.HeaderOriginalExchange]
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
	old := signedCopy(wire.Keys{k1})
	if (wire.Keys{k2}).Verify(old, "m-1", []byte("body")) {
		t.Fatal("a copy signed with another key verifies")
	}
	// During a rotation every key verifies, whichever signed.
	both := wire.Keys{k2, k1}
	if !both.Verify(old, "m-1", []byte("body")) || !both.Verify(signedCopy(both), "m-1", []byte("body")) {
		t.Fatal("a key of the list does not verify")
	}
	if !(wire.Keys{k2}).Verify(signedCopy(both), "m-1", []byte("body")) {
		t.Fatal("the first key does not sign")
	}
	// A key that signs only from tomorrow verifies today, and the next key signs.
	tomorrow := wire.Key{Secret: k2.Secret, SignsFrom: time.Now().Add(24 * time.Hour)}
	staged := wire.Keys{tomorrow, k1}
	h := signedCopy(staged)
	if !(wire.Keys{k1}).Verify(h, "m-1", []byte("body")) {
		t.Fatal("a key not yet due signed")
	}
	withNew := signedCopy(wire.Keys{k2})
	if !staged.Verify(withNew, "m-1", []byte("body")) {
		t.Fatal("a key not yet due does not verify")
	}
}

func TestSignRefusesHeadersIdemqDoesNotWrite(t *testing.T) {
	ks := wire.Keys{k1}
	h := amqp.Table{wire.HeaderAttempt: int64(2), wire.HeaderSignature: "v1.stale"}
	ks.Sign(h, "m", nil, time.Now())
	if _, ok := h[wire.HeaderSignature]; ok || ks.Verify(h, "m", nil) {
		t.Fatalf("signed a header of a type idemq does not write: %v", h)
	}
}

func TestValidate(t *testing.T) {
	if err := (wire.Keys{k1, k2}).Validate(); err != nil {
		t.Fatal(err)
	}
	if err := (wire.Keys{}).Validate(); err == nil {
		t.Fatal("no key: want an error")
	}
	err := (wire.Keys{k1, {Secret: []byte("tiny-secret")}}).Validate()
	if err == nil || strings.Contains(err.Error(), "tiny") {
		t.Fatalf("short key: %v (the error must not quote it)", err)
	}
}

func TestStrip(t *testing.T) {
	h := amqp.Table{"x-custom": 1, wire.HeaderAttempt: int32(9), "X-IDEMQ-TENANT": "mallory", wire.HeaderSignature: "v1.x"}
	orig := maps.Clone(h)
	got := wire.Strip(h)
	if len(got) != 1 || got["x-custom"] != 1 {
		t.Fatalf("Strip = %v", got)
	}
	if !maps.Equal(h, orig) {
		t.Fatal("Strip changed its argument")
	}
	clean := amqp.Table{"a": "b"}
	if got := wire.Strip(clean); len(got) != 1 {
		t.Fatalf("Strip of a table without idemq headers = %v", got)
	}
	if wire.Strip(nil) != nil {
		t.Fatal("Strip(nil) != nil")
	}
}

// TestSignatureIsBoundToQueueAndConsumer: a copy signed for the consumer A
// of queue QA verifies there and nowhere else: not for another queue, not
// for another consumer, not for both, and not for keys bound to no queue.
func TestSignatureIsBoundToQueueAndConsumer(t *testing.T) {
	ks := wire.Keys{k1}
	h := signedCopy(ks.For("QA", "A"))
	if !strings.HasPrefix(h[wire.HeaderSignature].(string), "v2.") {
		t.Fatalf("signature %q, want v2.", h[wire.HeaderSignature])
	}
	if !ks.For("QA", "A").Verify(h, "m-1", []byte("body")) {
		t.Fatal("a copy does not verify where it was signed for")
	}
	for _, other := range []struct{ queue, consumer string }{
		{"QB", "B"}, {"QA", "B"}, {"QB", "A"},
		// The parts are length-prefixed: moving a byte across does not match.
		{"QAA", ""}, {"Q", "AA"}, {"", "QAA"},
	} {
		if ks.For(other.queue, other.consumer).Verify(h, "m-1", []byte("body")) {
			t.Errorf("a copy signed for QA/A verifies for %s/%s", other.queue, other.consumer)
		}
	}
	if ks.Verify(h, "m-1", []byte("body")) {
		t.Error("a copy signed for QA/A verifies under keys bound to no queue")
	}
	if ks.For("QA", "A").Verify(signedCopy(ks), "m-1", []byte("body")) {
		t.Error("a copy signed by keys bound to no queue verifies for QA/A")
	}
	// Rotation still holds within one binding.
	both := wire.Keys{k2, k1}.For("QA", "A")
	if !both.Verify(h, "m-1", []byte("body")) || !(wire.Keys{k2}).For("QA", "A").Verify(signedCopy(both), "m-1", []byte("body")) {
		t.Error("a bound key list does not verify what one of its keys signed")
	}
}

// TestV1SignatureIsNotTrusted: a copy signed before signatures named their
// queue ("v1.", the golden retry copy of compat_test.go, made by the version
// before) verifies under no binding of its very key: after the upgrade it is
// an unsigned copy, a first attempt.
func TestV1SignatureIsNotTrusted(t *testing.T) {
	const v1 = "v1._HzWnclKaFhPK2MOISmcvcbYXPnat34OWThRJmwqE-M"
	h := with(goldenRetry, amqp.Table{wire.HeaderSignature: v1})
	v1Keys := wire.Keys{{Secret: []byte("a header key of the golden test")}}
	for _, ks := range []wire.Keys{v1Keys, v1Keys.For("q", "payments"), v1Keys.For("", "")} {
		if ks.Verify(h, "op-1", []byte(`{"amount":5}`)) {
			t.Errorf("a v1 signature verifies")
		}
	}
}
