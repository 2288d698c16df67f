package outbox

import (
	"math"
	"reflect"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// The codec keeps every AMQP type, including the floats that JSON and
// RabbitMQ cannot carry as numbers.
func TestHeadersRoundTrip(t *testing.T) {
	in := amqp.Table{
		"bool": false, "u8": uint8(1), "i8": int8(-128), "i16": int16(math.MinInt16), "i32": int32(math.MaxInt32),
		"i64": int64(math.MinInt64), "u16": uint16(math.MaxUint16), "u32": uint32(math.MaxUint32),
		"f32": float32(-0.1), "f64": 1e300, "inf": math.Inf(1), "ninf": math.Inf(-1),
		"dec": amqp.Decimal{Scale: 255, Value: -1}, "str": "", "bytes": []byte{}, "ts": time.Unix(-5, 0),
		"arr": []any{}, "tab": amqp.Table{"t": amqp.Table{"x": nil}},
	}
	b, err := encodeHeaders(in)
	if err != nil {
		t.Fatal(err)
	}
	out, err := decodeHeaders(b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(out, in) {
		t.Fatalf("round trip:\n got %#v\nwant %#v", out, in)
	}
	nan, _ := encodeHeaders(amqp.Table{"n": math.NaN()})
	if out, err := decodeHeaders(nan); err != nil || !math.IsNaN(out["n"].(float64)) {
		t.Fatalf("NaN round trip = %v, %v", out, err)
	}
	if b, err := encodeHeaders(nil); b != nil || err != nil {
		t.Fatalf("empty headers = %q, %v", b, err)
	}
	if _, err := encodeHeaders(amqp.Table{"x": uint64(1)}); err == nil {
		t.Fatal("uint64 header accepted")
	}
	if _, err := decodeHeaders([]byte(`{"x":{"t":"complex","v":1}}`)); err == nil {
		t.Fatal("unknown type accepted")
	}
}
