package integration

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testenv"
)

// badCase is one hostile message and how it must end: processed (a row in
// the received table, its body intact) or in the DLQ with reason.
type badCase struct {
	name   string
	msg    amqp.Publishing
	reason string // "" = processed
	tenant string // the tenant it is processed under
	key    string // the key it is processed under
}

// allTypes holds a header of every type amqp091-go writes.
func allTypes() amqp.Table {
	return amqp.Table{
		"t-bool": true, "t-int8": int8(-8), "t-int16": int16(-1600), "t-int32": int32(-320000),
		"t-int64": int64(-64 << 40), "t-int": 42, "t-uint8": uint8(200), "t-uint16": uint16(60000),
		"t-uint32": uint32(4000000000), "t-float32": float32(3.25), "t-float64": 6.02214076e23,
		"t-decimal": amqp.Decimal{Scale: 2, Value: 12345}, "t-string": "ünïcode ✓",
		"t-bytes": []byte{0, 1, 2, 0xfe, 0xff}, "t-time": time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC),
		"t-table":    amqp.Table{"inner": "v", "deeper": amqp.Table{"n": int32(1), "list": []any{"a", int64(2)}}},
		"t-array":    []any{"s", int32(1), true, nil, []byte("b"), amqp.Table{"k": "v"}, []any{float64(1.5)}},
		"t-nil":      nil,
		"t-empty":    "",
		"t-emptyarr": []any{},
		// Headers idemq itself reads, with types it does not expect.
		consumer.HeaderAttempt: amqp.Table{"not": "a number"},
		"traceparent":          []byte("\xff not a traceparent"),
		"tracestate":           int32(7),
	}
}

// TestBadInput sends bodies of 0 bytes and 16 MiB, binary bodies, headers of
// every AMQP type, keys of 255 and 256 bytes, keys that are not UTF-8 and
// odd tenants through a real consumer: each message ends processed or in
// the DLQ with a reason, and the consumer keeps going.
func TestBadInput(t *testing.T) {
	t.Parallel()
	e := testenv.New(t)
	ctx := context.Background()
	if _, err := e.Pool.Exec(ctx, `CREATE TABLE `+e.Schema+`.received (
    name text NOT NULL, tenant text NOT NULL, key text NOT NULL, size integer NOT NULL, sha text NOT NULL, attempt integer NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	cfg, events := e.ConsumerConfig("it.badinput", "bad-input")
	cfg.Concurrency = 4

	big := make([]byte, 16<<20)
	if _, err := rand.Read(big); err != nil {
		t.Fatal(err)
	}
	binary := make([]byte, 0, 512)
	for i := range 512 {
		binary = append(binary, byte(i))
	}
	long255, long256 := strings.Repeat("k", 255), strings.Repeat("k", 256)
	multi255 := strings.Repeat("é", 127) + "x" // 255 bytes, 128 runes
	withKey := func(name, key string, h amqp.Table, body []byte) amqp.Publishing {
		if h == nil {
			h = amqp.Table{}
		}
		h["x-case"] = name
		return amqp.Publishing{MessageId: key, Headers: h, Body: body, DeliveryMode: amqp.Persistent}
	}
	inHeader := func(name string, key any, h amqp.Table) amqp.Publishing {
		if h == nil {
			h = amqp.Table{}
		}
		h[consumer.DefaultKeyHeader] = key
		return withKey(name, "", h, []byte(name))
	}
	tenant := func(name string, tenant any) amqp.Publishing {
		return withKey(name, "tenant-case-key", amqp.Table{consumer.DefaultTenantHeader: tenant}, []byte(name))
	}
	cases := []badCase{
		{name: "empty body", msg: withKey("empty body", "bad-empty", nil, []byte{}), key: "bad-empty"},
		{name: "nil body", msg: withKey("nil body", "bad-nil", nil, nil), key: "bad-nil"},
		{name: "16 MiB body", msg: withKey("16 MiB body", "bad-16mib", nil, big), key: "bad-16mib"},
		{name: "binary body", msg: withKey("binary body", "bad-binary", nil, binary), key: "bad-binary"},
		{name: "every header type", msg: withKey("every header type", "bad-types", allTypes(), []byte("{}")), key: "bad-types"},
		{name: "every header type, retried", msg: withKey("every header type, retried", "bad-types-retry", allTypes(), []byte("{}")), key: "bad-types-retry"},
		{name: "every header type, no key", msg: withKey("every header type, no key", "", allTypes(), []byte("{}")), reason: consumer.ReasonKeyRequired},
		{name: "key 255 bytes in message_id", msg: withKey("key 255 bytes in message_id", long255, nil, []byte("x")), key: long255},
		{name: "key 255 bytes in header", msg: inHeader("key 255 bytes in header", long255, amqp.Table{consumer.DefaultTenantHeader: "h"}), tenant: "h", key: long255},
		{name: "key 255 bytes, 2-byte runes", msg: inHeader("key 255 bytes, 2-byte runes", multi255, nil), key: multi255},
		{name: "key 256 bytes in header", msg: inHeader("key 256 bytes in header", long256, nil), reason: consumer.ReasonKeyInvalid},
		{name: "key not UTF-8, bytes", msg: inHeader("key not UTF-8, bytes", []byte("key-\xff\xfe"), nil), reason: consumer.ReasonKeyInvalid},
		{name: "key not UTF-8, string", msg: inHeader("key not UTF-8, string", "key-\xc3\x28", nil), reason: consumer.ReasonKeyInvalid},
		{name: "key with a control character", msg: inHeader("key with a control character", "key\x07bell", nil), reason: consumer.ReasonKeyInvalid},
		{name: "key as bytes", msg: inHeader("key as bytes", []byte("bytes-key"), nil), key: "bytes-key"},
		{name: "key of another type", msg: inHeader("key of another type", int64(12345), nil), reason: consumer.ReasonKeyInvalid},
		{name: "no key at all", msg: withKey("no key at all", "", nil, []byte("x")), reason: consumer.ReasonKeyRequired},
		{name: "tenant with odd characters", msg: tenant("tenant with odd characters", "Ümlaut Straße/ü t:with spaces#%&?=;"), tenant: "Ümlaut Straße/ü t:with spaces#%&?=;", key: "tenant-case-key"},
		{name: "tenant like SQL", msg: tenant("tenant like SQL", "'; DROP TABLE keys; --"), tenant: "'; DROP TABLE keys; --", key: "tenant-case-key"},
		{name: "tenant emoji", msg: tenant("tenant emoji", "🔑 tenant"), tenant: "🔑 tenant", key: "tenant-case-key"},
		{name: "tenant 255 bytes", msg: tenant("tenant 255 bytes", strings.Repeat("t", 255)), tenant: strings.Repeat("t", 255), key: "tenant-case-key"},
		{name: "tenant as bytes", msg: tenant("tenant as bytes", []byte("bytes-tenant")), tenant: "bytes-tenant", key: "tenant-case-key"},
		{name: "tenant 256 bytes", msg: tenant("tenant 256 bytes", strings.Repeat("t", 256)), reason: consumer.ReasonKeyInvalid},
		{name: "tenant not UTF-8", msg: tenant("tenant not UTF-8", []byte("t-\xff")), reason: consumer.ReasonKeyInvalid},
		{name: "tenant with a newline", msg: tenant("tenant with a newline", "a\nb"), reason: consumer.ReasonKeyInvalid},
		{name: "tenant of another type", msg: tenant("tenant of another type", int32(7)), reason: consumer.ReasonKeyInvalid},
		{name: "tenant nil", msg: tenant("tenant nil", nil), reason: consumer.ReasonKeyInvalid},
	}
	for _, c := range cases {
		if _, dup := c.msg.Headers["x-case"]; !dup {
			t.Fatalf("case %q has no x-case header", c.name)
		}
	}

	// The headers of "every header type, retried" as its first attempt saw them.
	var (
		sentMu sync.Mutex
		sent   amqp.Table
	)
	e.Run(cfg, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		name, _ := d.Headers["x-case"].(string)
		if name == "every header type, retried" {
			// The retry copy must carry every header as the first delivery had it.
			seen := userHeaders(d.Headers)
			sentMu.Lock()
			defer sentMu.Unlock()
			if d.Attempt == 1 {
				sent = seen
				return consumer.Response{}, errors.New("injected failure: try again")
			}
			if diff := headerDiff(sent, seen); diff != "" {
				return consumer.Response{}, consumer.Permanent(fmt.Errorf("headers changed on the retry copy: %s", diff))
			}
		}
		sum := sha256.Sum256(d.Body)
		_, err := tx.Exec(ctx, `INSERT INTO `+e.Schema+`.received (name, tenant, key, size, sha, attempt) VALUES ($1, $2, $3, $4, $5, $6)`,
			name, d.Tenant, d.Key, len(d.Body), hex.EncodeToString(sum[:]), d.Attempt)
		return consumer.Response{Code: 200}, err
	})
	for _, c := range cases {
		testamqp.Publish(t, e.Pub, "", cfg.Queue, c.msg)
	}

	// Wait until every case is settled: a received row or a dead letter.
	topo := consumer.NewTopology(cfg.TopologyConfig())
	conn := testamqp.Dial(t)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		var received int
		if err := e.Pool.QueryRow(ctx, `SELECT count(*) FROM `+e.Schema+`.received`).Scan(&received); err != nil {
			t.Fatal(err)
		}
		q, err := ch.QueueDeclarePassive(topo.DLQ, true, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		if received+q.Messages >= len(cases) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 2m: %d processed, %d dead letters, of %d cases", received, q.Messages, len(cases))
		}
		drain(events)
		time.Sleep(100 * time.Millisecond)
	}

	// What was processed, with its body intact.
	type got struct {
		tenant, key, sha string
		size, n          int
	}
	processed := map[string]*got{}
	rows, err := e.Pool.Query(ctx, `SELECT name, tenant, key, size, sha FROM `+e.Schema+`.received`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var name string
		g := &got{n: 1}
		if err := rows.Scan(&name, &g.tenant, &g.key, &g.size, &g.sha); err != nil {
			t.Fatal(err)
		}
		if old := processed[name]; old != nil {
			g.n += old.n
		}
		processed[name] = g
	}
	// What was dead-lettered, with its reason.
	dead := map[string]amqp.Delivery{}
	for {
		d, ok, err := ch.Get(topo.DLQ, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			break
		}
		name, _ := d.Headers["x-case"].(string)
		dead[name] = d
	}
	for _, c := range cases {
		g, d := processed[c.name], dead[c.name]
		switch {
		case c.reason == "":
			if g == nil {
				t.Errorf("%s: not processed (dead-lettered: %v %v)", c.name, d.Headers[consumer.HeaderReason], d.Headers[consumer.HeaderError])
				continue
			}
			sum := sha256.Sum256(c.msg.Body)
			if g.n != 1 || g.tenant != c.tenant || g.key != c.key || g.size != len(c.msg.Body) || g.sha != hex.EncodeToString(sum[:]) {
				t.Errorf("%s: processed %d times as tenant %q key %.20q, %d bytes; want once as %q %.20q, %d bytes, same hash",
					c.name, g.n, g.tenant, g.key, g.size, c.tenant, c.key, len(c.msg.Body))
			}
		default:
			if g != nil {
				t.Errorf("%s: processed, want the DLQ with %s", c.name, c.reason)
				continue
			}
			if d.Headers == nil {
				t.Errorf("%s: neither processed nor dead-lettered", c.name)
				continue
			}
			if r := d.Headers[consumer.HeaderReason]; r != c.reason {
				t.Errorf("%s: dead-lettered with reason %v, want %s", c.name, r, c.reason)
			}
			if e, _ := d.Headers[consumer.HeaderError].(string); e == "" {
				t.Errorf("%s: dead letter without %s", c.name, consumer.HeaderError)
			}
			if !bytes.Equal(d.Body, c.msg.Body) {
				t.Errorf("%s: dead letter body differs", c.name)
			}
		}
	}
	// The dead letter of a message with every header type keeps them all.
	if d, ok := dead["every header type, no key"]; ok {
		want := allTypes()
		for k := range want {
			if _, ok := d.Headers[k]; !ok {
				t.Errorf("dead letter lost header %s", k)
			}
		}
	}

	// Still alive: a plain message after all that is processed.
	testamqp.Publish(t, e.Pub, "", cfg.Queue, withKey("after", "bad-after", nil, []byte("ok")))
	deadline = time.Now().Add(time.Minute)
	for {
		var n int
		if err := e.Pool.QueryRow(ctx, `SELECT count(*) FROM `+e.Schema+`.received WHERE name = 'after'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the consumer did not process a plain message after the bad input: stalled")
		}
		drain(events)
		time.Sleep(100 * time.Millisecond)
	}
}

// userHeaders drops the headers that idemq, OpenTelemetry and the broker's
// dead-lettering (the retry tiers) write on copies.
func userHeaders(h amqp.Table) amqp.Table {
	out := maps.Clone(h)
	for k := range out {
		if strings.HasPrefix(k, "x-idemq-") || strings.HasPrefix(k, "x-death") || strings.HasPrefix(k, "x-first-death-") ||
			strings.HasPrefix(k, "x-last-death-") || k == "traceparent" || k == "tracestate" {
			delete(out, k)
		}
	}
	return out
}

// drain empties the events channel so that the consumer never blocks on it.
func drain(events <-chan consumer.Event) {
	for {
		select {
		case <-events:
		default:
			return
		}
	}
}

// headerDiff says which headers differ between a and b ("" if none).
func headerDiff(a, b amqp.Table) string {
	var out []string
	for k := range a {
		if !reflect.DeepEqual(a[k], b[k]) {
			out = append(out, fmt.Sprintf("%s: %T %#v -> %T %#v", k, a[k], a[k], b[k], b[k]))
		}
	}
	for k := range b {
		if _, ok := a[k]; !ok {
			out = append(out, fmt.Sprintf("%s: added %T %#v", k, b[k], b[k]))
		}
	}
	return strings.Join(out, "; ")
}
