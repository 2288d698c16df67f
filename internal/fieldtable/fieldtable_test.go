package fieldtable_test

import (
	"bytes"
	"encoding/binary"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/internal/fieldtable"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// cases holds one value of every Go type amqp091-go writes: the value, its
// encoding as field "k" of a table (type byte and value), and what a
// consumer receives for it.
var cases = []struct {
	name string
	in   any
	wire string
	out  any
}{
	{"true", true, "t\x01", true},
	{"false", false, "t\x00", false},
	{"uint8", uint8(200), "B\xc8", uint8(200)},
	{"int8", int8(-3), "b\xfd", int8(-3)},
	{"int16", int16(-300), "s\xfe\xd4", int16(-300)},
	{"uint16", uint16(65000), "u\xfd\xe8", uint16(65000)},
	{"int32", int32(-70000), "I\xff\xfe\xee\x90", int32(-70000)},
	{"int", 42, "I\x00\x00\x00\x2a", int32(42)},
	{"int beyond int32", 1<<32 + 5, "I\x00\x00\x00\x05", int32(5)},
	{"uint32", uint32(4000000000), "i\xee\x6b\x28\x00", uint32(4000000000)},
	{"int64", int64(math.MinInt64), "l\x80\x00\x00\x00\x00\x00\x00\x00", int64(math.MinInt64)},
	{"float32", float32(1.5), "f\x3f\xc0\x00\x00", float32(1.5)},
	{"float64", 0.1, "d\x3f\xb9\x99\x99\x99\x99\x99\x9a", 0.1},
	{"+Inf", math.Inf(1), "d\x7f\xf0\x00\x00\x00\x00\x00\x00", math.Inf(1)},
	{"decimal", amqp.Decimal{Scale: 2, Value: -12345}, "D\x02\xff\xff\xcf\xc7", amqp.Decimal{Scale: 2, Value: -12345}},
	{"string", "héllo", "S\x00\x00\x00\x06h\xc3\xa9llo", "héllo"},
	{"string with NUL and invalid UTF-8", "a\x00b\xff\xfe", "S\x00\x00\x00\x05a\x00b\xff\xfe", "a\x00b\xff\xfe"},
	{"empty string", "", "S\x00\x00\x00\x00", ""},
	{"bytes", []byte{0, 1, 255}, "x\x00\x00\x00\x03\x00\x01\xff", []byte{0, 1, 255}},
	{"nil bytes", []byte(nil), "x\x00\x00\x00\x00", []byte{}},
	{"timestamp", time.Unix(1700000000, 0), "T\x00\x00\x00\x00\x65\x53\xf1\x00", time.Unix(1700000000, 0)},
	{"timestamp in UTC with nanoseconds", time.Unix(1700000000, 999).UTC(), "T\x00\x00\x00\x00\x65\x53\xf1\x00", time.Unix(1700000000, 0)},
	{"timestamp before 1970", time.Unix(-1, 0), "T\xff\xff\xff\xff\xff\xff\xff\xff", time.Unix(-1, 0)},
	{"nil", nil, "V", nil},
	{"array", []any{"a", int32(1), []any{false}}, "A\x00\x00\x00\x12S\x00\x00\x00\x01aI\x00\x00\x00\x01A\x00\x00\x00\x02t\x00",
		[]any{"a", int32(1), []any{false}}},
	{"empty array", []any{}, "A\x00\x00\x00\x00", []any(nil)},
	{"table", amqp.Table{"\xff\x00": int64(1)}, "F\x00\x00\x00\x0c\x02\xff\x00l\x00\x00\x00\x00\x00\x00\x00\x01",
		amqp.Table{"\xff\x00": int64(1)}},
	{"nil table", amqp.Table(nil), "F\x00\x00\x00\x00", amqp.Table{}},
	{"array of tables", []any{amqp.Table{}, amqp.Table{"a": nil}}, "A\x00\x00\x00\x0dF\x00\x00\x00\x00F\x00\x00\x00\x03\x01aV",
		[]any{amqp.Table{}, amqp.Table{"a": nil}}},
}

// field returns the encoded table whose only field is name, encoded as wire.
func field(name, wire string) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(1+len(name)+len(wire)))
	b = append(b, byte(len(name)))
	b = append(b, name...)
	return append(b, wire...)
}

func TestEncodeEveryType(t *testing.T) {
	for _, c := range cases {
		got, err := fieldtable.Encode(amqp.Table{"k": c.in})
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		if want := field("k", c.wire); !bytes.Equal(got, want) {
			t.Errorf("%s: encoded\n %q, want\n %q", c.name, got, want)
		}
		if n, err := fieldtable.Size(amqp.Table{"k": c.in}); n != len(got) || err != nil {
			t.Errorf("%s: size %d, %v; encoded %d bytes", c.name, n, err, len(got))
		}
	}
}

func TestDecodeEveryType(t *testing.T) {
	for _, c := range cases {
		got, err := fieldtable.Decode(field("k", c.wire))
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		if want := (amqp.Table{"k": c.out}); !reflect.DeepEqual(got, want) {
			t.Errorf("%s: decoded %#v, want %#v", c.name, got, want)
		}
	}
}

// every holds every type at once, with the names and strings that JSON
// cannot carry.
var every = amqp.Table{
	"bool": true, "u8": uint8(1), "i8": int8(-128), "i16": int16(math.MinInt16), "u16": uint16(math.MaxUint16),
	"i32": int32(math.MaxInt32), "int": -7, "u32": uint32(math.MaxUint32), "i64": int64(math.MaxInt64),
	"f32": float32(-0.1), "f64": 1e300, "dec": amqp.Decimal{Scale: 255, Value: -1},
	"str": "NUL\x00inside", "\xffname\x00": "value\xfe\xff", "": "empty name", strings.Repeat("n", 255): "longest name",
	"bytes": []byte("\x00\xff"), "ts": time.Unix(1700000000, 0), "nil": nil,
	"arr": []any{"a\x00", []byte{}, []any{}, amqp.Table{"in\x00": []any{int16(1)}}},
	"tab": amqp.Table{"deeper": amqp.Table{"\x00": "\x00"}},
}

// What Encode writes is what amqp091-go writes, and what Decode reads is
// what amqp091-go reads, for every type.
func TestAsAmqp091(t *testing.T) {
	tables := []amqp.Table{every}
	for _, c := range cases {
		tab := amqp.Table{"k": c.in}
		tables = append(tables, tab)
		enc, err := fieldtable.Encode(tab)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if ref := amqpWrites(t, tab); !bytes.Equal(enc, ref) {
			t.Errorf("%s: encoded\n %q, amqp091-go writes\n %q", c.name, enc, ref)
		}
	}
	for _, tab := range tables {
		enc, err := fieldtable.Encode(tab)
		if err != nil {
			t.Fatalf("%#v: %v", tab, err)
		}
		got, err := fieldtable.Decode(enc)
		if err != nil {
			t.Fatalf("%#v: decode: %v", tab, err)
		}
		ref, err := amqpReads(t, enc)
		if err != nil {
			t.Fatalf("%#v: amqp091-go cannot read the encoding: %v", tab, err)
		}
		if !reflect.DeepEqual(got, ref) {
			t.Errorf("decoded\n %#v, amqp091-go reads\n %#v", got, ref)
		}
	}
}

// nest returns a table with depth levels of tables (or arrays) inside.
func nest(depth int, array bool) amqp.Table {
	var v any
	for range depth {
		if array {
			v = []any{v}
		} else {
			v = amqp.Table{"n": v}
		}
	}
	return amqp.Table{"top": v}
}

// The limits are amqp091-go's reader's: 32 levels inside the top table,
// 8192 fields or items per container.
func TestLimits(t *testing.T) {
	for _, array := range []bool{false, true} {
		ok, err := fieldtable.Encode(nest(32, array))
		if err != nil {
			t.Fatalf("32 levels (arrays %v): %v", array, err)
		}
		if _, err := fieldtable.Decode(ok); err != nil {
			t.Fatalf("32 levels (arrays %v): decode: %v", array, err)
		}
		if _, err := amqpReads(t, ok); err != nil {
			t.Fatalf("32 levels (arrays %v): amqp091-go: %v", array, err)
		}
		if _, err := fieldtable.Encode(nest(33, array)); err == nil {
			t.Errorf("33 levels (arrays %v) encoded", array)
		}
		if _, err := fieldtable.Size(nest(33, array)); err == nil {
			t.Errorf("33 levels (arrays %v) sized", array)
		}
		deep := amqpWrites(t, nest(33, array))
		if _, err := fieldtable.Decode(deep); err == nil {
			t.Errorf("33 levels (arrays %v) decoded", array)
		}
		if _, err := amqpReads(t, deep); err == nil {
			t.Errorf("33 levels (arrays %v): amqp091-go read it; the limit changed", array)
		}
	}

	cycle := amqp.Table{}
	cycle["self"] = cycle
	if _, err := fieldtable.Encode(cycle); err == nil {
		t.Error("a table containing itself encoded")
	}

	items := make([]any, 8192)
	fields := amqp.Table{}
	for i := range 8192 {
		fields[string(binary.BigEndian.AppendUint16(nil, uint16(i)))] = nil
	}
	for name, tab := range map[string]amqp.Table{"8192 items": {"a": items}, "8192 fields": fields} {
		enc, err := fieldtable.Encode(tab)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if got, err := fieldtable.Decode(enc); err != nil || !reflect.DeepEqual(got, tab) {
			t.Fatalf("%s: decoded %d fields, %v", name, len(got), err)
		}
	}
	fields["one more"] = nil
	items = append(items, nil)
	for name, tab := range map[string]amqp.Table{"8193 items": {"a": items}, "8193 fields": fields} {
		if _, err := fieldtable.Encode(tab); err == nil {
			t.Errorf("%s encoded", name)
		}
	}
	// The same, written by hand: 8193 nil items, 8193 fields.
	var hand []byte
	for i := range 8193 {
		hand = append(binary.BigEndian.AppendUint16(append(hand, 2), uint16(i)), 'V')
	}
	if _, err := fieldtable.Decode(prefixed(hand)); err == nil {
		t.Error("8193 fields decoded")
	}
	if _, err := fieldtable.Decode(field("a", "A"+string(prefixed(bytes.Repeat([]byte{'V'}, 8193))))); err == nil {
		t.Error("8193 items decoded")
	}
}

// prefixed returns b after its 4-byte length.
func prefixed(b []byte) []byte {
	return append(binary.BigEndian.AppendUint32(nil, uint32(len(b))), b...)
}

func TestDecodeRefusesMalformed(t *testing.T) {
	enc, err := fieldtable.Encode(every)
	if err != nil {
		t.Fatal(err)
	}
	for n := range len(enc) {
		if _, err := fieldtable.Decode(enc[:n]); err == nil {
			t.Fatalf("the first %d of %d bytes decoded", n, len(enc))
		}
	}
	if _, err := fieldtable.Decode(append(enc, 0)); err == nil {
		t.Error("a byte after the table decoded")
	}
	// Malformed inside a well-framed table: amqp091-go refuses these too.
	for name, b := range map[string][]byte{
		"unknown type":          field("k", "Z"),
		"string of 2^31 bytes":  field("k", "S\x80\x00\x00\x00"),
		"bytes of -1 bytes":     field("k", "x\xff\xff\xff\xff"),
		"string past the table": field("k", "S\x00\x00\x00\x02a"),
		"name past the table":   prefixed([]byte("\x05ab")),
	} {
		if _, err := fieldtable.Decode(b); err == nil {
			t.Errorf("%s: decoded", name)
		}
		if _, err := amqpReads(t, b); err == nil {
			t.Errorf("%s: amqp091-go read it", name)
		}
	}
	// amqp091-go cuts these arrays short without an error; a stored table
	// that ends this way is damaged, so Decode refuses it.
	for name, b := range map[string][]byte{
		"array past its table":           field("k", "A\x00\x00\x00\x09V"),
		"array ending inside an item":    field("k", "A\x00\x00\x00\x01I"),
		"array ending inside an integer": field("k", "A\x00\x00\x00\x03I\x00\x00"),
	} {
		if _, err := fieldtable.Decode(b); err == nil {
			t.Errorf("%s: decoded", name)
		}
	}
}

func TestDecodeDoesNotAliasItsInput(t *testing.T) {
	b := field("k", "x\x00\x00\x00\x01a")
	got, err := fieldtable.Decode(b)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)-1] = 'b'
	if v := got["k"].([]byte); string(v) != "a" {
		t.Fatalf("decoded bytes changed with the input: %q", v)
	}
	// Any non-zero boolean octet is true, as amqp091-go reads it.
	if got, err := fieldtable.Decode(field("k", "t\x02")); err != nil || got["k"] != true {
		t.Fatalf("boolean 2 = %v, %v", got, err)
	}
}

func TestEncodeRefuses(t *testing.T) {
	type named string
	for name, tab := range map[string]amqp.Table{
		"uint64":               {"k": uint64(1)},
		"uint":                 {"k": uint(1)},
		"map":                  {"k": map[string]any{}},
		"struct":               {"k": struct{}{}},
		"named string":         {"k": named("x")},
		"[]string":             {"k": []string{"x"}},
		"nested uint64":        {"k": []any{amqp.Table{"k": uint64(1)}}},
		"name of 256 bytes":    {strings.Repeat("n", 256): 1},
		"nested long name":     {"k": amqp.Table{strings.Repeat("n", 256): 1}},
		"pointer to a table":   {"k": &amqp.Table{}},
		"pointer to a string":  {"k": new(string)},
		"a table's own values": {"k": amqp.Table{"k": complex(1, 1)}},
	} {
		if _, err := fieldtable.Encode(tab); err == nil {
			t.Errorf("%s: encoded", name)
		}
		if _, err := fieldtable.Size(tab); err == nil {
			t.Errorf("%s: sized", name)
		}
	}
	if b, err := fieldtable.Encode(nil); err != nil || string(b) != "\x00\x00\x00\x00" {
		t.Errorf("nil table: %q, %v", b, err)
	}
}
