package outbox

import (
	"math"
	"reflect"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Rows written before migration 004 still decode: this is the JSON the old
// encoder wrote for a header of every type.
func TestDecodeJSONHeaders(t *testing.T) {
	stored := `{"bool": {"t": "bool", "v": false}, "u8": {"t": "uint8", "v": 1}, "i8": {"t": "int8", "v": -128},
		"i16": {"t": "int16", "v": -32768}, "i32": {"t": "int32", "v": 2147483647},
		"i64": {"t": "int64", "v": -9223372036854775808}, "u16": {"t": "uint16", "v": 65535},
		"u32": {"t": "uint32", "v": 4294967295}, "f32": {"t": "float32", "v": -0.1}, "f64": {"t": "float64", "v": 1e+300},
		"inf": {"t": "float64", "v": "+Inf"}, "ninf": {"t": "float64", "v": "-Inf"},
		"dec": {"t": "decimal", "v": {"scale": 255, "value": -1}}, "str": {"t": "string", "v": "héllo"},
		"bytes": {"t": "bytes", "v": "AAH/"}, "ts": {"t": "timestamp", "v": -5}, "arr": {"t": "array", "v": []},
		"tab": {"t": "table", "v": {"t": {"t": "table", "v": {"x": {"t": "null"}}}}}}`
	want := amqp.Table{
		"bool": false, "u8": uint8(1), "i8": int8(-128), "i16": int16(math.MinInt16), "i32": int32(math.MaxInt32),
		"i64": int64(math.MinInt64), "u16": uint16(math.MaxUint16), "u32": uint32(math.MaxUint32),
		"f32": float32(-0.1), "f64": 1e300, "inf": math.Inf(1), "ninf": math.Inf(-1),
		"dec": amqp.Decimal{Scale: 255, Value: -1}, "str": "héllo", "bytes": []byte{0, 1, 255}, "ts": time.Unix(-5, 0),
		"arr": []any{}, "tab": amqp.Table{"t": amqp.Table{"x": nil}},
	}
	got, err := decodeHeaders(nil, []byte(stored))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("decoded:\n got %#v\nwant %#v", got, want)
	}
	if out, err := decodeHeaders(nil, []byte(`{"n": {"t": "float64", "v": "NaN"}}`)); err != nil || !math.IsNaN(out["n"].(float64)) {
		t.Fatalf("NaN = %v, %v", out, err)
	}
	if _, err := decodeHeaders(nil, []byte(`{"x":{"t":"complex","v":1}}`)); err == nil {
		t.Fatal("unknown type accepted")
	}
	if h, err := decodeHeaders(nil, nil); h != nil || err != nil {
		t.Fatalf("no headers = %v, %v", h, err)
	}
}

// A row with both columns is read from headers_amqp.
func TestDecodeHeadersPrefersTheFieldTable(t *testing.T) {
	table, err := encodeHeaders(amqp.Table{"a": "\x00"})
	if err != nil {
		t.Fatal(err)
	}
	got, err := decodeHeaders(table, []byte(`{"a": {"t": "string", "v": "json"}}`))
	if err != nil || !reflect.DeepEqual(got, amqp.Table{"a": "\x00"}) {
		t.Fatalf("decoded %#v, %v", got, err)
	}
	if b, err := encodeHeaders(nil); b != nil || err != nil {
		t.Fatalf("empty headers = %q, %v", b, err)
	}
	if _, err := encodeHeaders(amqp.Table{"x": uint64(1)}); err == nil {
		t.Fatal("uint64 header accepted")
	}
}
