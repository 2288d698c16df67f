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

// Rows written before migration 004 hold their headers in headers_jsonb, as
// JSON in a typed encoding: every value an object {"t": type, "v": value},
// the type names those of the Go values amqp091-go reads off the wire:
//
//	bool, uint8, int8, int16, int32, int64, uint16, uint32 (JSON numbers),
//	float32, float64 (numbers; "NaN", "+Inf", "-Inf" as strings),
//	decimal ({"scale": n, "value": n}), string, bytes (base64),
//	timestamp (Unix seconds, as AMQP carries them), array, table, null.
//
// Nothing writes it any more; the relay reads it for those rows. It can go
// in a release whose migration finds no pending or parked row holding it.

type typedValue struct {
	T string          `json:"t"`
	V json.RawMessage `json:"v,omitempty"`
}

// decodeJSONHeaders reads headers_jsonb; empty input gives nil.
func decodeJSONHeaders(b []byte) (amqp.Table, error) {
	if len(b) == 0 {
		return nil, nil
	}
	var raw map[string]typedValue
	if err := json.Unmarshal(b, &raw); err != nil {
		return nil, err
	}
	return decodeTable(raw)
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
