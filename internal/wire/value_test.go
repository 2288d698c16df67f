package wire_test

import (
	"math"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/wire"
)

func TestInt(t *testing.T) {
	for _, c := range []struct {
		v    any
		want int64
		ok   bool
	}{
		{int8(-3), -3, true}, {int16(300), 300, true}, {int32(7), 7, true}, {int64(math.MaxInt64), math.MaxInt64, true},
		{42, 42, true}, {uint8(200), 200, true}, {uint16(math.MaxUint16), math.MaxUint16, true},
		{uint32(math.MaxUint32), math.MaxUint32, true}, {float32(2.5), 2, true}, {-2.9, -2, true},
		{" 12 ", 12, true}, {[]byte("5"), 5, true},
		{math.NaN(), 0, false}, {math.Inf(1), 0, false}, {1e300, 0, false}, {"1.5", 0, false}, {"", 0, false},
		{true, 0, false}, {amqp.Decimal{Scale: 0, Value: 3}, 0, false}, {time.Unix(3, 0), 0, false}, {nil, 0, false},
		{amqp.Table{}, 0, false}, {[]any{int32(1)}, 0, false},
	} {
		if got, ok := wire.Int(c.v); got != c.want || ok != c.ok {
			t.Errorf("Int(%#v) = %d, %v; want %d, %v", c.v, got, ok, c.want, c.ok)
		}
	}
}

func TestString(t *testing.T) {
	for _, c := range []struct {
		v    any
		want string
		ok   bool
	}{
		{"a", "a", true}, {[]byte("b\xff"), "b\xff", true}, {[]byte{}, "", true},
		{int32(1), "", false}, {nil, "", false}, {amqp.Table{"a": "b"}, "", false},
	} {
		if got, ok := wire.String(c.v); got != c.want || ok != c.ok {
			t.Errorf("String(%#v) = %q, %v; want %q, %v", c.v, got, ok, c.want, c.ok)
		}
	}
}
