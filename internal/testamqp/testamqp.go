// Package testamqp gives integration tests a real RabbitMQ, with unique
// names per test and a way to break a test's own connections.
//
// The broker comes from IDEMQ_TEST_AMQP_URL (default: the local guest
// account). A test that cannot reach it fails with a clear message; it never
// skips.
package testamqp

import (
	"context"
	"fmt"
	"io"
	"maps"
	"math"
	"net"
	"net/url"
	"os"
	"os/exec"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/testdb"
)

// DefaultURL is the broker used when IDEMQ_TEST_AMQP_URL is unset.
const DefaultURL = "amqp://guest:guest@127.0.0.1:5672/"

// URL returns the test broker URL.
func URL() string {
	if u := os.Getenv("IDEMQ_TEST_AMQP_URL"); u != "" {
		return u
	}
	return DefaultURL
}

// Name returns a unique name for a queue or exchange of one test. Every
// connection a test names after it (see Config) can be closed with
// CloseConnections.
func Name(tb testing.TB, prefix string) string {
	tb.Helper()
	return fmt.Sprintf("%s.%s", prefix, testdb.RandomHex(5))
}

// Config returns an amqp.Config whose connection carries the given name, so
// that CloseConnections can find it.
func Config(connectionName string) amqp.Config {
	props := amqp.NewConnectionProperties()
	props.SetClientConnectionName(connectionName)
	return amqp.Config{Properties: props, Heartbeat: 10 * time.Second}
}

// Dial opens a connection for the test's own use (publishing, inspecting
// queues) and closes it when the test ends. It fails the test if RabbitMQ
// does not answer.
func Dial(tb testing.TB) *amqp.Connection {
	tb.Helper()
	return DialURL(tb, URL())
}

// DialURL is Dial with another URL (another user, see AddUser).
func DialURL(tb testing.TB, url string) *amqp.Connection {
	tb.Helper()
	conn, err := amqp.DialConfig(url, Config("idemq-test-"+tb.Name()))
	if err != nil {
		tb.Fatalf("testamqp: RabbitMQ is not reachable (run `make up`, or set IDEMQ_TEST_AMQP_URL): %v", err)
	}
	tb.Cleanup(func() { _ = conn.Close() })
	return conn
}

// Channel opens a channel in confirm mode on conn.
func Channel(tb testing.TB, conn *amqp.Connection) *amqp.Channel {
	tb.Helper()
	ch, err := conn.Channel()
	if err != nil {
		tb.Fatalf("testamqp: open channel: %v", err)
	}
	if err := ch.Confirm(false); err != nil {
		tb.Fatalf("testamqp: confirm mode: %v", err)
	}
	tb.Cleanup(func() { _ = ch.Close() })
	return ch
}

// Publish publishes msg to the default exchange with routing key queue and
// waits for the broker's confirm.
func Publish(tb testing.TB, ch *amqp.Channel, exchange, key string, msg amqp.Publishing) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conf, err := ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, false, false, msg)
	if err != nil {
		tb.Fatalf("testamqp: publish: %v", err)
	}
	ok, err := conf.WaitContext(ctx)
	if err != nil || !ok {
		tb.Fatalf("testamqp: publish not confirmed: ok=%v err=%v", ok, err)
	}
}

// Sink declares a durable exchange of the kind given and a durable queue
// bound to it with key, where a test reads what was published to the
// exchange.
func Sink(tb testing.TB, ch *amqp.Channel, exchange, kind, queue, key string) {
	tb.Helper()
	if err := ch.ExchangeDeclare(exchange, kind, true, false, false, false, nil); err != nil {
		tb.Fatalf("testamqp: declare exchange: %v", err)
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		tb.Fatalf("testamqp: declare queue: %v", err)
	}
	if err := ch.QueueBind(queue, key, exchange, false, nil); err != nil {
		tb.Fatalf("testamqp: bind queue: %v", err)
	}
}

// EveryHeaderType returns headers of every type amqp091-go writes, with
// what JSON cannot carry: strings holding NUL bytes, a name and a value that
// are not UTF-8, nested tables and arrays. A test compares what went through
// idemq with what a consumer receives for the same table published directly.
func EveryHeaderType() amqp.Table {
	return amqp.Table{
		"bool": true, "u8": uint8(200), "i8": int8(-3), "i16": int16(math.MinInt16), "u16": uint16(math.MaxUint16),
		"i32": int32(-70000), "int": 42, "u32": uint32(math.MaxUint32), "i64": int64(math.MaxInt64),
		"f32": float32(-0.1), "f64": 1e300, "dec": amqp.Decimal{Scale: 2, Value: -12345},
		"str": "héllo", "nul": "a\x00b\x00", "\xffname\x00": "value\xfe\xff",
		"bytes": []byte{0, 1, 255}, "no-bytes": []byte{}, "ts": time.Unix(1700000000, 0), "nil": nil,
		"arr": []any{"a\x00", int64(-1), []any{false, "\xc3"}, amqp.Table{"in\x00": []byte("\xff")}},
		"tab": amqp.Table{"deeper": amqp.Table{"\xfe": "\x00", "list": []any{}}},
	}
}

// HeadersDiff lists, one line per field, how got differs from want; "" when
// they are deeply equal.
func HeadersDiff(got, want amqp.Table) string {
	var b strings.Builder
	for _, k := range slices.Sorted(maps.Keys(want)) {
		g, ok := got[k]
		if !ok {
			fmt.Fprintf(&b, "\n  %q missing, want %#v", k, want[k])
		} else if !reflect.DeepEqual(g, want[k]) {
			fmt.Fprintf(&b, "\n  %q = %#v, want %#v", k, g, want[k])
		}
	}
	for _, k := range slices.Sorted(maps.Keys(got)) {
		if _, ok := want[k]; !ok {
			fmt.Fprintf(&b, "\n  %q = %#v, not wanted", k, got[k])
		}
	}
	return b.String()
}

// DeleteQueuesAtCleanup deletes the named queues and exchanges when the test ends.
func DeleteQueuesAtCleanup(tb testing.TB, queues, exchanges []string) {
	tb.Cleanup(func() {
		conn, err := amqp.Dial(URL())
		if err != nil {
			return
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			return
		}
		for _, q := range queues {
			_, _ = ch.QueueDelete(q, false, false, false)
		}
		for _, x := range exchanges {
			_ = ch.ExchangeDelete(x, false, false)
		}
	})
}

var connectionName = regexp.MustCompile(`\{"connection_name","([^"]*)"\}`)

// CloseConnections closes, from the broker's side, every connection whose
// name starts with prefix, as `rabbitmqctl close_connection` does, and
// returns how many it closed. Other tests' connections are left alone.
func CloseConnections(tb testing.TB, prefix string) int {
	tb.Helper()
	out, err := exec.CommandContext(context.Background(), "rabbitmqctl", "list_connections", "-q", "--no-table-headers", "pid", "client_properties").Output()
	if err != nil {
		tb.Fatalf("testamqp: rabbitmqctl list_connections: %v", err)
	}
	closed := 0
	for _, line := range strings.Split(string(out), "\n") {
		pid, props, ok := strings.Cut(line, "\t")
		if !ok {
			continue
		}
		m := connectionName.FindStringSubmatch(props)
		if m == nil || !strings.HasPrefix(m[1], prefix) {
			continue
		}
		if out, err := exec.CommandContext(context.Background(), "rabbitmqctl", "close_connection", pid, "closed by test").CombinedOutput(); err != nil {
			tb.Logf("testamqp: close_connection %s: %v: %s", pid, err, out)
			continue
		}
		closed++
	}
	return closed
}

// Unacked returns how many of queue's messages are delivered and not yet
// acked, as the broker counts them (`rabbitmqctl list_queues`).
func Unacked(tb testing.TB, queue string) int {
	tb.Helper()
	out, err := exec.CommandContext(context.Background(), "rabbitmqctl", "list_queues", "-q", "--no-table-headers", "name", "messages_unacknowledged").Output()
	if err != nil {
		tb.Fatalf("testamqp: rabbitmqctl list_queues: %v", err)
	}
	for _, line := range strings.Split(string(out), "\n") {
		name, n, ok := strings.Cut(strings.TrimSpace(line), "\t")
		if !ok || name != queue {
			continue
		}
		v, err := strconv.Atoi(strings.TrimSpace(n))
		if err != nil {
			tb.Fatalf("testamqp: unacked count of %s: %q: %v", queue, n, err)
		}
		return v
	}
	tb.Fatalf("testamqp: queue %s not listed by rabbitmqctl", queue)
	return 0
}

// AddUser creates a broker user named prefix plus a random suffix, with a
// random password and every permission on the test vhost, and deletes it
// when the test ends. It returns the user name and an AMQP URL that logs in
// as that user. For tests of what RabbitMQ checks per user (user_id).
func AddUser(tb testing.TB, prefix string) (user, url string) {
	tb.Helper()
	uri, err := amqp.ParseURI(URL())
	if err != nil {
		tb.Fatalf("testamqp: parse %s: %v", URL(), err)
	}
	user, password := prefix+"-"+testdb.RandomHex(4), testdb.RandomHex(16)
	ctl := func(args ...string) {
		tb.Helper()
		if out, err := exec.CommandContext(context.Background(), "rabbitmqctl", args...).CombinedOutput(); err != nil {
			tb.Fatalf("testamqp: rabbitmqctl %s: %v: %s", args[0], err, out)
		}
	}
	ctl("add_user", user, password)
	tb.Cleanup(func() {
		if out, err := exec.CommandContext(context.Background(), "rabbitmqctl", "delete_user", user).CombinedOutput(); err != nil {
			tb.Logf("testamqp: rabbitmqctl delete_user %s: %v: %s", user, err, out)
		}
	})
	ctl("set_permissions", "-p", uri.Vhost, user, ".*", ".*", ".*")
	uri.Username, uri.Password = user, password
	return user, uri.String()
}

// SetPermissions grants user every permission on the test vhost (allow) or
// clears them all, so that the broker refuses the user's connections to it
// with 530 NOT_ALLOWED. For tests of what a consumer does when the broker
// starts refusing it.
func SetPermissions(tb testing.TB, user string, allow bool) {
	tb.Helper()
	uri, err := amqp.ParseURI(URL())
	if err != nil {
		tb.Fatalf("testamqp: parse %s: %v", URL(), err)
	}
	args := []string{"clear_permissions", "-p", uri.Vhost, user}
	if allow {
		args = []string{"set_permissions", "-p", uri.Vhost, user, ".*", ".*", ".*"}
	}
	if out, err := exec.CommandContext(context.Background(), "rabbitmqctl", args...).CombinedOutput(); err != nil {
		tb.Fatalf("testamqp: rabbitmqctl %s: %v: %s", args[0], err, out)
	}
}

// Proxy is a TCP proxy in front of the test broker, for tests of a broker
// node that goes away: it forwards every connection it accepts until Kill,
// which closes its listener (later connects are refused) and cuts every
// connection through it. Cut and Restore make an outage that ends: Cut does
// what Kill does, and Restore listens again on the same address.
type Proxy struct {
	// URL is the test broker's URL with the proxy's address.
	URL string

	target string
	wg     sync.WaitGroup
	mu     sync.Mutex
	ln     net.Listener
	conns  map[net.Conn]struct{}
	dead   bool
	seen   int
}

// NewProxy starts a proxy to the test broker; it is killed when the test
// ends.
func NewProxy(tb testing.TB) *Proxy {
	tb.Helper()
	u, err := url.Parse(URL())
	if err != nil {
		tb.Fatalf("testamqp: parse the broker URL: %v", err)
	}
	target := u.Host
	if u.Port() == "" {
		target = net.JoinHostPort(u.Hostname(), "5672")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("testamqp: proxy listen: %v", err)
	}
	u.Host = ln.Addr().String()
	p := &Proxy{URL: u.String(), target: target, ln: ln, conns: map[net.Conn]struct{}{}}
	p.wg.Go(func() { p.serve(ln) })
	tb.Cleanup(p.Kill)
	return p
}

// serve forwards the connections ln accepts until ln is closed.
func (p *Proxy) serve(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		up, err := net.DialTimeout("tcp", p.target, 5*time.Second)
		if err != nil || !p.track(c, up) {
			_ = c.Close()
			if up != nil {
				_ = up.Close()
			}
			continue
		}
		pipe := func(dst, src net.Conn) {
			_, _ = io.Copy(dst, src)
			_ = dst.Close()
			_ = src.Close()
			p.untrack(dst, src)
		}
		p.wg.Go(func() { pipe(up, c) })
		p.wg.Go(func() { pipe(c, up) })
	}
}

func (p *Proxy) track(cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.dead || p.ln == nil {
		return false
	}
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
	p.seen++
	return true
}

func (p *Proxy) untrack(cs ...net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range cs {
		delete(p.conns, c)
	}
}

// Active is the number of connections open through the proxy.
func (p *Proxy) Active() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns) / 2
}

// Accepted is the number of connections the proxy has forwarded so far.
func (p *Proxy) Accepted() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.seen
}

// Cut makes the broker out of reach through the proxy: it closes the
// listener (connects are refused) and cuts every connection through it,
// until Restore.
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closeLocked()
}

// Restore ends the outage of Cut: the proxy listens again on its address.
// It fails the test when the address cannot be listened on again.
func (p *Proxy) Restore(tb testing.TB) {
	tb.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.dead || p.ln != nil {
		return
	}
	u, err := url.Parse(p.URL)
	if err != nil {
		tb.Fatalf("testamqp: parse the proxy URL: %v", err)
	}
	ln, err := net.Listen("tcp", u.Host)
	if err != nil {
		tb.Fatalf("testamqp: proxy listen again on %s: %v", u.Host, err)
	}
	p.ln = ln
	p.wg.Go(func() { p.serve(ln) })
}

// Kill closes the listener and every connection through the proxy, and
// waits for its goroutines. Killing twice is safe.
func (p *Proxy) Kill() {
	p.mu.Lock()
	p.dead = true
	p.closeLocked()
	p.mu.Unlock()
	p.wg.Wait()
}

// closeLocked closes the listener and cuts every connection.
func (p *Proxy) closeLocked() {
	if p.ln != nil {
		_ = p.ln.Close()
		p.ln = nil
	}
	for c := range p.conns {
		_ = c.Close()
	}
}
