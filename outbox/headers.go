package outbox

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Headers are stored as jsonb in a typed encoding: every value is an object
// {"t": type, "v": value}, so that an int64 comes back an int64, a []byte a
// []byte and a timestamp a time.Time, exactly as the AMQP field table would
// carry them. The type names are those of the Go values amqp091-go reads
// off the wire:
//
//	bool, uint8, int8, int16, int32, int64, uint16, uint32 (JSON numbers),
//	float32, float64 (numbers; "NaN", "+Inf", "-Inf" as strings),
//	decimal ({"scale": n, "value": n}), string, bytes (base64),
//	timestamp (Unix seconds, as AMQP carries them), array, table, null.
//
// A Go int is stored as int32, which is what amqp091-go writes for it.

type typedValue struct {
	T string          `json:"t"`
	V json.RawMessage `json:"v,omitempty"`
}

// encodeHeaders returns the jsonb form of t, or nil for an empty table.
func encodeHeaders(t amqp.Table) ([]byte, error) {
	if len(t) == 0 {
		return nil, nil
	}
	if err := t.Validate(); err != nil {
		return nil, fmt.Errorf("headers: %w", err)
	}
	enc, err := encodeTable(t)
	if err != nil {
		return nil, fmt.Errorf("headers: %w", err)
	}
	return json.Marshal(enc)
}

func encodeTable(t amqp.Table) (map[string]typedValue, error) {
	out := make(map[string]typedValue, len(t))
	for k, v := range t {
		tv, err := encodeValue(v)
		if err != nil {
			return nil, fmt.Errorf("field %q: %w", k, err)
		}
		out[k] = tv
	}
	return out, nil
}

func encodeValue(v any) (typedValue, error) {
	num := func(t string, n any) (typedValue, error) {
		b, err := json.Marshal(n)
		return typedValue{T: t, V: b}, err
	}
	float := func(t string, f float64, bits int) (typedValue, error) {
		switch {
		case math.IsNaN(f):
			return num(t, "NaN")
		case math.IsInf(f, 1):
			return num(t, "+Inf")
		case math.IsInf(f, -1):
			return num(t, "-Inf")
		}
		return typedValue{T: t, V: json.RawMessage(strconv.FormatFloat(f, 'g', -1, bits))}, nil
	}
	switch x := v.(type) {
	case nil:
		return typedValue{T: "null"}, nil
	case bool:
		return num("bool", x)
	case uint8:
		return num("uint8", x)
	case int8:
		return num("int8", x)
	case int16:
		return num("int16", x)
	case int:
		return num("int32", int32(x))
	case int32:
		return num("int32", x)
	case int64:
		return num("int64", x)
	case uint16:
		return num("uint16", x)
	case uint32:
		return num("uint32", x)
	case float32:
		return float("float32", float64(x), 32)
	case float64:
		return float("float64", x, 64)
	case amqp.Decimal:
		return num("decimal", map[string]any{"scale": x.Scale, "value": x.Value})
	case string:
		return num("string", x)
	case []byte:
		return num("bytes", base64.StdEncoding.EncodeToString(x))
	case time.Time:
		return num("timestamp", x.Unix())
	case []any:
		arr := make([]typedValue, len(x))
		for i, e := range x {
			tv, err := encodeValue(e)
			if err != nil {
				return typedValue{}, fmt.Errorf("array item %d: %w", i, err)
			}
			arr[i] = tv
		}
		return num("array", arr)
	case amqp.Table:
		tab, err := encodeTable(x)
		if err != nil {
			return typedValue{}, err
		}
		return num("table", tab)
	}
	return typedValue{}, fmt.Errorf("value of type %T not supported by AMQP", v)
}

// decodeHeaders is the inverse of encodeHeaders; nil or empty input gives nil.
func decodeHeaders(b []byte) (amqp.Table, error) {
	if len(b) == 0 {
		return nil, nil
	}
	var raw map[string]typedValue
	if err := json.Unmarshal(b, &raw); err != nil {
		return nil, fmt.Errorf("headers: %w", err)
	}
	t, err := decodeTable(raw)
	if err != nil {
		return nil, fmt.Errorf("headers: %w", err)
	}
	return t, nil
}

func decodeTable(raw map[string]typedValue) (amqp.Table, error) {
	t := make(amqp.Table, len(raw))
	for k, tv := range raw {
		v, err := decodeValue(tv)
		if err != nil {
			return nil, fmt.Errorf("field %q: %w", k, err)
		}
		t[k] = v
	}
	return t, nil
}

func decodeValue(tv typedValue) (any, error) {
	integer := func(bits int, signed bool) (int64, uint64, error) {
		s := string(tv.V)
		if signed {
			n, err := strconv.ParseInt(s, 10, bits)
			return n, 0, err
		}
		n, err := strconv.ParseUint(s, 10, bits)
		return 0, n, err
	}
	float := func(bits int) (float64, error) {
		var s string
		if json.Unmarshal(tv.V, &s) == nil {
			switch s {
			case "NaN":
				return math.NaN(), nil
			case "+Inf":
				return math.Inf(1), nil
			case "-Inf":
				return math.Inf(-1), nil
			}
			return 0, fmt.Errorf("bad float %q", s)
		}
		return strconv.ParseFloat(string(tv.V), bits)
	}
	switch tv.T {
	case "null":
		return nil, nil
	case "bool":
		var b bool
		err := json.Unmarshal(tv.V, &b)
		return b, err
	case "uint8":
		_, n, err := integer(8, false)
		return uint8(n), err
	case "int8":
		n, _, err := integer(8, true)
		return int8(n), err
	case "int16":
		n, _, err := integer(16, true)
		return int16(n), err
	case "int32":
		n, _, err := integer(32, true)
		return int32(n), err
	case "int64":
		n, _, err := integer(64, true)
		return n, err
	case "uint16":
		_, n, err := integer(16, false)
		return uint16(n), err
	case "uint32":
		_, n, err := integer(32, false)
		return uint32(n), err
	case "float32":
		f, err := float(32)
		return float32(f), err
	case "float64":
		return float(64)
	case "decimal":
		var d struct {
			Scale uint8 `json:"scale"`
			Value int32 `json:"value"`
		}
		err := json.Unmarshal(tv.V, &d)
		return amqp.Decimal{Scale: d.Scale, Value: d.Value}, err
	case "string":
		var s string
		err := json.Unmarshal(tv.V, &s)
		return s, err
	case "bytes":
		var s string
		if err := json.Unmarshal(tv.V, &s); err != nil {
			return nil, err
		}
		return base64.StdEncoding.DecodeString(s)
	case "timestamp":
		n, _, err := integer(64, true)
		return time.Unix(n, 0), err
	case "array":
		var raw []typedValue
		if err := json.Unmarshal(tv.V, &raw); err != nil {
			return nil, err
		}
		arr := make([]any, len(raw))
		for i, e := range raw {
			v, err := decodeValue(e)
			if err != nil {
				return nil, fmt.Errorf("array item %d: %w", i, err)
			}
			arr[i] = v
		}
		return arr, nil
	case "table":
		var raw map[string]typedValue
		if err := json.Unmarshal(tv.V, &raw); err != nil {
			return nil, err
		}
		return decodeTable(raw)
	}
	return nil, fmt.Errorf("unknown header type %q", tv.T)
}
