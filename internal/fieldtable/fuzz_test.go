package fieldtable_test

import (
	"math"
	"reflect"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/fieldtable"
)

// FuzzRoundTrip decodes arbitrary bytes; whatever decodes must encode, in
// Size bytes, and decode again to the same table. The seed corpus is in
// testdata/fuzz and runs with every go test; make fuzz explores further.
func FuzzRoundTrip(f *testing.F) {
	f.Fuzz(func(t *testing.T, b []byte) {
		tab, err := fieldtable.Decode(b)
		if err != nil {
			return
		}
		enc, err := fieldtable.Encode(tab)
		if err != nil {
			t.Fatalf("decoded %#v, which does not encode: %v", tab, err)
		}
		if n, err := fieldtable.Size(tab); n != len(enc) || err != nil {
			t.Fatalf("size %d, %v; encoded %d bytes", n, err, len(enc))
		}
		back, err := fieldtable.Decode(enc)
		if err != nil {
			t.Fatalf("encoding of %#v does not decode: %v", tab, err)
		}
		if !same(back, tab) {
			t.Fatalf("round trip:\n got %#v\nwant %#v", back, tab)
		}
	})
}

// same is reflect.DeepEqual, except that floats are equal when their bits
// are (NaN included).
func same(a, b any) bool {
	switch x := a.(type) {
	case float32:
		y, ok := b.(float32)
		return ok && math.Float32bits(x) == math.Float32bits(y)
	case float64:
		y, ok := b.(float64)
		return ok && math.Float64bits(x) == math.Float64bits(y)
	case []any:
		y, ok := b.([]any)
		if !ok || len(x) != len(y) || (x == nil) != (y == nil) {
			return false
		}
		for i := range x {
			if !same(x[i], y[i]) {
				return false
			}
		}
		return true
	case amqp.Table:
		y, ok := b.(amqp.Table)
		if !ok || len(x) != len(y) || (x == nil) != (y == nil) {
			return false
		}
		for k, v := range x {
			w, ok := y[k]
			if !ok || !same(v, w) {
				return false
			}
		}
		return true
	}
	return reflect.DeepEqual(a, b)
}
