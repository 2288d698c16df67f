// Package fieldtable is the AMQP 0-9-1 field-table encoding, byte for byte
// as amqp091-go v1.16.0 writes and reads it on the wire (RabbitMQ's
// dialect of the spec).
//
// Encode writes what amqp091-go's writer writes for a table, and Decode gives
// back what amqp091-go's reader hands a consumer for those bytes, so
// Decode(Encode(t)) is the table a consumer would receive had t been
// published directly. Strings and field names are bytes: NUL bytes and
// invalid UTF-8 come back unchanged.
//
// Go type to field type, as amqp091-go maps them (Decode returns the type on
// the right of each arrow):
//
//	bool 't', uint8 'B', int8 'b', int16 's', uint16 'u', int32 'I', uint32 'i',
//	int64 'l', float32 'f', float64 'd', amqp.Decimal 'D', string 'S',
//	[]byte 'x', time.Time 'T' (Unix seconds; comes back time.Unix(s, 0)),
//	[]any 'A', amqp.Table 'F', nil 'V'
//	int 'I' → int32 (truncated, as amqp091-go does)
//	[]byte(nil) → []byte{}; []any{} → []any(nil); amqp.Table(nil) → amqp.Table{}
//
// The encoding is the table as a long string: a 4-byte big-endian length,
// then each field as a short-string name, a type byte and the value. The
// order of the fields is Go's map order, so two encodings of one table may
// differ in their bytes, never in what they decode to.
//
// Both directions refuse what amqp091-go's reader refuses: tables and
// arrays nested deeper than 32 levels, more than 8192 fields in one table or
// items in one array, and strings, byte arrays and containers longer than
// 2^31-1 bytes. A table a consumer cannot read is refused when it is
// encoded, not when it is delivered. Decode is stricter than amqp091-go on
// malformed input: it refuses bytes after the table and an array that ends
// inside an item or runs past its container, which amqp091-go cuts short
// without an error.
package fieldtable

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// The limits of amqp091-go's reader (maxFieldDepth, maxContainerElements,
// and the longest string or container it reads).
const (
	maxDepth    = 32
	maxElements = 8192
	maxLong     = math.MaxInt32
	maxShort    = math.MaxUint8
)

// Size returns the length of Encode(t) in bytes, without encoding it, or the
// error Encode would return. It counts the 4-byte length prefix: it is what
// the headers add to a content header frame.
func Size(t amqp.Table) (int, error) {
	n, err := tableSize(t, 0)
	if err != nil {
		return 0, fmt.Errorf("fieldtable: %w", err)
	}
	return n, nil
}

// Encode returns the wire encoding of t, with its length prefix. An empty or
// nil table is 4 zero bytes. It fails on a value of a type AMQP cannot carry,
// a field name longer than 255 bytes, and past the limits of the package
// documentation.
func Encode(t amqp.Table) ([]byte, error) {
	n, err := Size(t)
	if err != nil {
		return nil, err
	}
	return appendTable(make([]byte, 0, n), t), nil
}

// Decode reads one encoded table, length prefix included, and nothing after
// it. Byte arrays are copied: the result does not alias b.
func Decode(b []byte) (amqp.Table, error) {
	d := decoder{b: b}
	t, err := d.table(0)
	if err == nil && len(d.b) > 0 {
		err = fmt.Errorf("%d bytes after the table", len(d.b))
	}
	if err != nil {
		return nil, fmt.Errorf("fieldtable: %w", err)
	}
	return t, nil
}

var errTooDeep = fmt.Errorf("nested deeper than %d levels", maxDepth)

// tableSize checks t, nested depth levels deep, and returns its encoded size.
func tableSize(t amqp.Table, depth int) (int, error) {
	if depth > maxDepth {
		return 0, errTooDeep
	}
	if len(t) > maxElements {
		return 0, fmt.Errorf("%d fields: more than %d", len(t), maxElements)
	}
	n := 4
	for k, v := range t {
		if len(k) > maxShort {
			return 0, fmt.Errorf("field name %q: longer than %d bytes", k, maxShort)
		}
		vn, err := fieldSize(v, depth)
		if err != nil {
			return 0, fmt.Errorf("field %q: %w", k, err)
		}
		n += 1 + len(k) + vn
	}
	if n-4 > maxLong {
		return 0, fmt.Errorf("table of %d bytes: longer than %d", n-4, maxLong)
	}
	return n, nil
}

// fieldSize checks v, a value in a container depth levels deep, and returns
// its encoded size, type byte included.
func fieldSize(v any, depth int) (int, error) {
	switch x := v.(type) {
	case nil:
		return 1, nil
	case bool, uint8, int8:
		return 2, nil
	case int16, uint16:
		return 3, nil
	case int, int32, uint32, float32:
		return 5, nil
	case amqp.Decimal:
		return 6, nil
	case int64, float64, time.Time:
		return 9, nil
	case string:
		return longSize(len(x))
	case []byte:
		return longSize(len(x))
	case []any:
		if depth+1 > maxDepth {
			return 0, errTooDeep
		}
		if len(x) > maxElements {
			return 0, fmt.Errorf("array of %d items: more than %d", len(x), maxElements)
		}
		n := 0
		for i, e := range x {
			en, err := fieldSize(e, depth+1)
			if err != nil {
				return 0, fmt.Errorf("array item %d: %w", i, err)
			}
			n += en
		}
		return longSize(n)
	case amqp.Table:
		n, err := tableSize(x, depth+1)
		return 1 + n, err
	}
	return 0, fmt.Errorf("unsupported type %T", v)
}

// longSize is the size of a type byte, a 4-byte length and n bytes.
func longSize(n int) (int, error) {
	if n > maxLong {
		return 0, fmt.Errorf("%d bytes: longer than %d", n, maxLong)
	}
	return 5 + n, nil
}

// appendTable appends the encoding of t, which tableSize has checked.
func appendTable(b []byte, t amqp.Table) []byte {
	start := len(b)
	b = append(b, 0, 0, 0, 0)
	for k, v := range t {
		b = append(b, byte(len(k)))
		b = append(b, k...)
		b = appendField(b, v)
	}
	binary.BigEndian.PutUint32(b[start:], uint32(len(b)-start-4))
	return b
}

// appendField appends the type byte and encoding of v, which fieldSize has
// checked.
func appendField(b []byte, v any) []byte {
	switch x := v.(type) {
	case nil:
		return append(b, 'V')
	case bool:
		if x {
			return append(b, 't', 1)
		}
		return append(b, 't', 0)
	case uint8:
		return append(b, 'B', x)
	case int8:
		return append(b, 'b', byte(x))
	case int16:
		return binary.BigEndian.AppendUint16(append(b, 's'), uint16(x))
	case uint16:
		return binary.BigEndian.AppendUint16(append(b, 'u'), x)
	case int:
		return binary.BigEndian.AppendUint32(append(b, 'I'), uint32(x))
	case int32:
		return binary.BigEndian.AppendUint32(append(b, 'I'), uint32(x))
	case uint32:
		return binary.BigEndian.AppendUint32(append(b, 'i'), x)
	case int64:
		return binary.BigEndian.AppendUint64(append(b, 'l'), uint64(x))
	case float32:
		return binary.BigEndian.AppendUint32(append(b, 'f'), math.Float32bits(x))
	case float64:
		return binary.BigEndian.AppendUint64(append(b, 'd'), math.Float64bits(x))
	case amqp.Decimal:
		return binary.BigEndian.AppendUint32(append(b, 'D', x.Scale), uint32(x.Value))
	case time.Time:
		return binary.BigEndian.AppendUint64(append(b, 'T'), uint64(x.Unix()))
	case string:
		return append(binary.BigEndian.AppendUint32(append(b, 'S'), uint32(len(x))), x...)
	case []byte:
		return append(binary.BigEndian.AppendUint32(append(b, 'x'), uint32(len(x))), x...)
	case []any:
		b = append(b, 'A', 0, 0, 0, 0)
		start := len(b)
		for _, e := range x {
			b = appendField(b, e)
		}
		binary.BigEndian.PutUint32(b[start-4:], uint32(len(b)-start))
		return b
	case amqp.Table:
		return appendTable(append(b, 'F'), x)
	}
	panic(fmt.Sprintf("fieldtable: %T passed fieldSize but has no encoding", v))
}

// decoder reads values off the front of b.
type decoder struct{ b []byte }

var errTruncated = errors.New("truncated")

func (d *decoder) take(n int) ([]byte, error) {
	if n > len(d.b) {
		return nil, errTruncated
	}
	p := d.b[:n:n]
	d.b = d.b[n:]
	return p, nil
}

func (d *decoder) uint8() (uint8, error) {
	p, err := d.take(1)
	if err != nil {
		return 0, err
	}
	return p[0], nil
}

func (d *decoder) uint16() (uint16, error) {
	p, err := d.take(2)
	if err != nil {
		return 0, err
	}
	return binary.BigEndian.Uint16(p), nil
}

func (d *decoder) uint32() (uint32, error) {
	p, err := d.take(4)
	if err != nil {
		return 0, err
	}
	return binary.BigEndian.Uint32(p), nil
}

func (d *decoder) uint64() (uint64, error) {
	p, err := d.take(8)
	if err != nil {
		return 0, err
	}
	return binary.BigEndian.Uint64(p), nil
}

// long reads a 4-byte length and that many bytes.
func (d *decoder) long() ([]byte, error) {
	n, err := d.uint32()
	if err != nil {
		return nil, err
	}
	if n > maxLong {
		return nil, fmt.Errorf("length %d: longer than %d", n, maxLong)
	}
	return d.take(int(n))
}

// table reads a table nested depth levels deep.
func (d *decoder) table(depth int) (amqp.Table, error) {
	if depth > maxDepth {
		return nil, errTooDeep
	}
	body, err := d.long()
	if err != nil {
		return nil, err
	}
	in := decoder{b: body}
	t := amqp.Table{}
	for len(in.b) > 0 {
		n, err := in.uint8()
		if err != nil {
			return nil, err
		}
		name, err := in.take(int(n))
		if err != nil {
			return nil, fmt.Errorf("field name: %w", err)
		}
		v, err := in.field(depth)
		if err != nil {
			return nil, fmt.Errorf("field %q: %w", name, err)
		}
		if len(t) >= maxElements {
			return nil, fmt.Errorf("more than %d fields", maxElements)
		}
		t[string(name)] = v
	}
	return t, nil
}

// array reads an array nested depth levels deep.
func (d *decoder) array(depth int) ([]any, error) {
	if depth > maxDepth {
		return nil, errTooDeep
	}
	body, err := d.long()
	if err != nil {
		return nil, err
	}
	in := decoder{b: body}
	var arr []any
	for len(in.b) > 0 {
		v, err := in.field(depth)
		if err != nil {
			return nil, fmt.Errorf("array item %d: %w", len(arr), err)
		}
		if len(arr) >= maxElements {
			return nil, fmt.Errorf("more than %d array items", maxElements)
		}
		arr = append(arr, v)
	}
	return arr, nil
}

// field reads a type byte and a value in a container depth levels deep.
func (d *decoder) field(depth int) (any, error) {
	typ, err := d.uint8()
	if err != nil {
		return nil, err
	}
	switch typ {
	case 't':
		v, err := d.uint8()
		return v != 0, err
	case 'B':
		return d.uint8()
	case 'b':
		v, err := d.uint8()
		return int8(v), err
	case 's':
		v, err := d.uint16()
		return int16(v), err
	case 'u':
		return d.uint16()
	case 'I':
		v, err := d.uint32()
		return int32(v), err
	case 'i':
		return d.uint32()
	case 'l':
		v, err := d.uint64()
		return int64(v), err
	case 'f':
		v, err := d.uint32()
		return math.Float32frombits(v), err
	case 'd':
		v, err := d.uint64()
		return math.Float64frombits(v), err
	case 'D':
		scale, err := d.uint8()
		if err != nil {
			return nil, err
		}
		v, err := d.uint32()
		return amqp.Decimal{Scale: scale, Value: int32(v)}, err
	case 'T':
		v, err := d.uint64()
		return time.Unix(int64(v), 0), err
	case 'S':
		p, err := d.long()
		return string(p), err
	case 'x':
		p, err := d.long()
		return append([]byte{}, p...), err
	case 'A':
		return d.array(depth + 1)
	case 'F':
		return d.table(depth + 1)
	case 'V':
		return nil, nil
	}
	return nil, fmt.Errorf("unknown field type %q", typ)
}
