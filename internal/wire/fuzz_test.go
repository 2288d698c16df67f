package wire_test

import (
	"errors"
	"math"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/wire"
)

// The seed corpora of these targets are in testdata/fuzz and run with every
// go test; make fuzz explores further.

// The default key and tenant headers of a consumer.
const (
	keyHeader    = "Idempotency-Key"
	tenantHeader = "x-tenant-id"
)

// headerValue builds a header value of one of the types amqp091-go decodes
// (kind picks it); ok is false for "no header at all".
func headerValue(kind uint8, raw []byte, i int64, f float64) (v any, ok bool) {
	switch kind % 18 {
	case 0:
		return string(raw), true
	case 1:
		return raw, true
	case 2:
		return int8(i), true
	case 3:
		return int16(i), true
	case 4:
		return int32(i), true
	case 5:
		return i, true
	case 6:
		return float32(f), true
	case 7:
		return f, true
	case 8:
		return amqp.Decimal{Scale: uint8(i), Value: int32(i >> 8)}, true
	case 9:
		return i%2 == 0, true
	case 10:
		return time.Unix(i%(1<<34), 0), true
	case 11:
		return amqp.Table{"nested": string(raw), "n": i}, true
	case 12:
		return []any{string(raw), i, nil}, true
	case 13:
		return nil, true
	case 14:
		return uint8(i), true
	case 15:
		return uint16(i), true
	case 16:
		return uint32(i), true
	}
	return nil, false
}

func isString(kind uint8) bool { return kind%18 == 0 || kind%18 == 1 }

func FuzzExtractKey(f *testing.F) {
	f.Add("order-42", uint8(0), []byte("ignored"), int64(0), 0.0)
	f.Add("", uint8(0), []byte("from-header"), int64(0), 0.0)
	f.Add("", uint8(1), []byte("bytes-\xff-key"), int64(0), 0.0)
	f.Add("", uint8(5), []byte(nil), int64(42), 0.0)
	f.Add("", uint8(13), []byte(nil), int64(0), 0.0)
	f.Add("", uint8(17), []byte(nil), int64(0), 0.0)
	f.Add("", uint8(11), []byte("nested"), int64(7), 1.5)
	f.Fuzz(func(t *testing.T, messageID string, kind uint8, raw []byte, i int64, fl float64) {
		d := amqp.Delivery{MessageId: messageID, Headers: amqp.Table{}}
		if v, ok := headerValue(kind, raw, i, fl); ok {
			d.Headers[keyHeader] = v
		}
		_, present := d.Headers[keyHeader]
		got, err := wire.ReadKey(&d, keyHeader)
		want, invalid := "", false
		switch {
		case messageID != "":
			want = messageID
		case isString(kind):
			want = string(raw)
		case present:
			// Present but not a string: an invalid key, not a missing one.
			invalid = true
		}
		if got != want || invalid != (err != nil) {
			t.Fatalf("ReadKey = %q, %v; want %q, invalid %v", got, err, want, invalid)
		}
	})
}

func FuzzExtractTenant(f *testing.F) {
	f.Add(false, "", uint8(0), []byte("acme"), int64(0))
	f.Add(false, "", uint8(0), []byte("Ümlaut Straße/ü t:with spaces#%&?=;"), int64(0))
	f.Add(false, "", uint8(1), []byte("bytes\xff"), int64(0))
	f.Add(false, "", uint8(0), []byte("tab\there"), int64(0))
	f.Add(false, "", uint8(0), []byte(strings.Repeat("t", 256)), int64(0))
	f.Add(false, "", uint8(4), []byte(nil), int64(3))
	f.Add(false, "", uint8(13), []byte(nil), int64(0))
	f.Add(false, "", uint8(17), []byte(nil), int64(0))
	f.Add(true, "guest", uint8(0), []byte("spoofed"), int64(0))
	f.Fuzz(func(t *testing.T, fromUserID bool, userID string, kind uint8, raw []byte, i int64) {
		d := amqp.Delivery{UserId: userID, Headers: amqp.Table{}}
		v, present := headerValue(kind, raw, i, 0)
		if present {
			d.Headers[tenantHeader] = v
		}
		got, err := wire.ReadTenant(&d, tenantHeader, fromUserID)
		source, typed := "", true
		switch {
		case fromUserID:
			source = userID
		case present && isString(kind):
			source = string(raw)
		case present:
			typed = false
		}
		valid := typed && len(source) <= 255 && utf8.ValidString(source) && !strings.ContainsFunc(source, unicode.IsControl)
		if valid != (err == nil) {
			t.Fatalf("ReadTenant(%q) = %q, %v; valid %v", source, got, err, valid)
		}
		if err != nil {
			if msg := err.Error(); !utf8.ValidString(msg) || len(msg) > 100 {
				t.Fatalf("error text %q is not short valid UTF-8", msg)
			}
			return
		}
		if got != source {
			t.Fatalf("ReadTenant = %q, want %q", got, source)
		}
	})
}

func FuzzParseAttempt(f *testing.F) {
	for kind := range uint8(18) {
		f.Add(kind, int64(3), 3.0, "3")
	}
	f.Add(uint8(0), int64(0), 0.0, " 7 ")
	f.Add(uint8(0), int64(0), 0.0, "2147483648")
	f.Add(uint8(5), int64(1<<30), 0.0, "")
	f.Add(uint8(5), int64(1<<30+1), 0.0, "")
	f.Add(uint8(5), int64(-5), 0.0, "")
	f.Add(uint8(7), int64(0), math.NaN(), "")
	f.Add(uint8(7), int64(0), math.Inf(1), "")
	f.Add(uint8(7), int64(0), 1e300, "")
	f.Add(uint8(16), int64(math.MaxUint32), 0.0, "")
	f.Fuzz(func(t *testing.T, kind uint8, i int64, fl float64, s string) {
		h := amqp.Table{}
		var want int64 = 1
		inRange := func(n int64) int64 {
			if n < 1 || n > 1<<30 {
				return 1
			}
			return n
		}
		switch kind % 18 {
		case 0, 1:
			if kind%18 == 0 {
				h[wire.HeaderAttempt] = s
			} else {
				h[wire.HeaderAttempt] = []byte(s)
			}
			if n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 32); err == nil {
				want = inRange(n)
			}
		case 2:
			h[wire.HeaderAttempt], want = int8(i), inRange(int64(int8(i)))
		case 3:
			h[wire.HeaderAttempt], want = int16(i), inRange(int64(int16(i)))
		case 4:
			h[wire.HeaderAttempt], want = int32(i), inRange(int64(int32(i)))
		case 5:
			h[wire.HeaderAttempt], want = i, inRange(i)
		case 6, 7:
			v := fl
			if kind%18 == 6 {
				h[wire.HeaderAttempt] = float32(fl)
				v = float64(float32(fl))
			} else {
				h[wire.HeaderAttempt] = fl
			}
			if v >= 1 && v < 1<<30+1 {
				want = int64(v)
			}
		case 14:
			h[wire.HeaderAttempt], want = uint8(i), inRange(int64(uint8(i)))
		case 15:
			h[wire.HeaderAttempt], want = uint16(i), inRange(int64(uint16(i)))
		case 16:
			h[wire.HeaderAttempt], want = uint32(i), inRange(int64(uint32(i)))
		default:
			if v, ok := headerValue(kind, []byte(s), i, fl); ok {
				h[wire.HeaderAttempt] = v
			}
		}
		got := wire.ParseAttempt(h)
		if got < 1 || got > 1<<30 {
			t.Fatalf("ParseAttempt(%#v) = %d, out of [1, 2^30]", h[wire.HeaderAttempt], got)
		}
		if int64(got) != want {
			t.Fatalf("ParseAttempt(%#v) = %d, want %d", h[wire.HeaderAttempt], got, want)
		}
	})
}

// reasons are the consumer's reason words, in the order the corpus indexes them.
var reasons = []string{
	"permanent_error", "max_attempts_exceeded", "idempotency_key_required",
	"idempotency_key_invalid", "idempotency_key_reuse",
}

func FuzzDeadLetterHeaders(f *testing.F) {
	f.Add(uint8(0), "decode payment: unexpected end of JSON input", true, 1)
	f.Add(uint8(1), "", false, 5)
	f.Add(uint8(2), "", true, 0)
	f.Add(uint8(3), "bad key \xff\xfe", true, 1)
	f.Add(uint8(4), strings.Repeat("é", 600), true, 3)
	f.Add(uint8(0), strings.Repeat("x", 1023)+"€", true, 2)
	f.Add(uint8(0), strings.Repeat("x", 2000), true, -1)
	f.Fuzz(func(t *testing.T, reasonIdx uint8, text string, withErr bool, attempts int) {
		reason := reasons[int(reasonIdx)%len(reasons)]
		var err error
		source := reason
		if withErr {
			err = errors.New(text)
			source = text
		}
		h := wire.DeadLetterHeaders(reason, err, attempts)
		if verr := h.Validate(); verr != nil {
			t.Fatalf("headers are not a valid AMQP table: %v", verr)
		}
		if h[wire.HeaderReason] != reason {
			t.Fatalf("reason %v, want %q", h[wire.HeaderReason], reason)
		}
		got, ok := h[wire.HeaderError].(string)
		if !ok || !utf8.ValidString(got) {
			t.Fatalf("x-idemq-error %q is not a valid UTF-8 string", h[wire.HeaderError])
		}
		const limit = 1024
		if len(got) > limit+len("…") {
			t.Fatalf("x-idemq-error is %d bytes, over %d", len(got), limit)
		}
		clean := strings.ToValidUTF8(source, "\uFFFD")
		if len(clean) <= limit {
			if got != clean {
				t.Fatalf("x-idemq-error %q, want %q", got, clean)
			}
		} else if cut, found := strings.CutSuffix(got, "…"); !found || !strings.HasPrefix(clean, cut) || len(cut) < limit-utf8.UTFMax {
			t.Fatalf("x-idemq-error is not a truncation of the error: %q", got)
		}
		if attempts >= math.MinInt32 && attempts <= math.MaxInt32 {
			if h[wire.HeaderAttempts] != int32(attempts) {
				t.Fatalf("attempts %v, want %d", h[wire.HeaderAttempts], attempts)
			}
		}
	})
}
