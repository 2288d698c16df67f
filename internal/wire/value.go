package wire

import (
	"math"
	"strconv"
	"strings"
)

// String reads a header value as text: a string, or bytes (a long string
// decoded as such, or a byte array). Any other type is not text (false).
func String(v any) (string, bool) {
	switch s := v.(type) {
	case string:
		return s, true
	case []byte:
		return string(s), true
	}
	return "", false
}

// Int reads a header value as an integer: any AMQP integer type, a float
// (truncated; NaN and floats out of range are not integers), or text
// holding a decimal integer, spaces around it allowed. Any other type or
// text is not an integer (false).
func Int(v any) (int64, bool) {
	switch n := v.(type) {
	case int8:
		return int64(n), true
	case int16:
		return int64(n), true
	case int32:
		return int64(n), true
	case int64:
		return n, true
	case int:
		return int64(n), true
	case uint8:
		return int64(n), true
	case uint16:
		return int64(n), true
	case uint32:
		return int64(n), true
	case float32:
		return floatInt(float64(n))
	case float64:
		return floatInt(n)
	}
	if s, ok := String(v); ok {
		i, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
		return i, err == nil
	}
	return 0, false
}

func floatInt(f float64) (int64, bool) {
	if math.IsNaN(f) || f < math.MinInt64 || f >= math.MaxInt64 {
		return 0, false
	}
	return int64(f), true
}
