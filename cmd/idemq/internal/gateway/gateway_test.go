package gateway_test

import (
	"bufio"
	"cmp"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/cmd/idemq/internal/gateway"
	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/dedup/deduptest"
	"github.com/idemq/idemq/dedup/idemhttp"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
)

// env is a gateway in front of a fresh schema, publishing to a fresh topic
// exchange whose queue (sink) keeps everything it receives.
type env struct {
	t    *testing.T
	addr string // host:port the gateway listens on
	url  string
	sink string
	ch   *amqp.Channel
	stop func()
}

func start(t *testing.T, cfg gateway.Config) *env {
	t.Helper()
	return launch(t, cfg, false)
}

// launch is start; with defaultExchange the gateway publishes to the default
// exchange "" and the sink is a plain queue, reached by its name.
func launch(t *testing.T, cfg gateway.Config, defaultExchange bool) *env {
	t.Helper()
	pool := testdb.Pool(t, 40)
	store := deduptest.Store(t, pool, nil)
	discard := slog.New(slog.NewTextHandler(io.Discard, nil))
	exchange := testamqp.Name(t, "gw")
	sink := exchange + ".sink"
	testamqp.DeleteQueuesAtCleanup(t, []string{sink}, []string{exchange})
	ch := testamqp.Channel(t, testamqp.Dial(t))
	cfg.Consumer = "gateway"
	if defaultExchange {
		if _, err := ch.QueueDeclare(sink, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		cfg.Exchange = ""
	} else {
		testamqp.Sink(t, ch, exchange, amqp.ExchangeTopic, sink, "#")
		cfg.Exchange = exchange
	}
	cfg.AMQPURL = cmp.Or(cfg.AMQPURL, testamqp.URL())
	cfg.Relay.Logger = discard
	cfg.Relay.ConnectionName = "idemq-test-" + exchange + "-relay"
	cfg.Logger = discard
	g, err := gateway.New(store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- g.Serve(ctx, ln) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("serve: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return &env{t: t, addr: ln.Addr().String(), url: "http://" + ln.Addr().String(), sink: sink, ch: ch, stop: stop}
}

type answer struct {
	status   int
	body     string
	replayed bool
}

func (e *env) post(path, key, contentType, body string, headers ...string) answer {
	e.t.Helper()
	req, err := http.NewRequest("POST", e.url+path, strings.NewReader(body))
	if err != nil {
		e.t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	req.Header.Set("Content-Type", contentType)
	for i := 0; i+1 < len(headers); i += 2 {
		if headers[i] == "Host" {
			req.Host = headers[i+1]
			continue
		}
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Error(err)
		return answer{}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return answer{status: resp.StatusCode, body: string(b), replayed: resp.Header.Get(idemhttp.ReplayedHeader) == "true"}
}

// drained stops the gateway (which flushes its outbox) and returns every
// message the sink queue holds.
func (e *env) drained() []amqp.Delivery {
	e.t.Helper()
	e.stop()
	var out []amqp.Delivery
	for {
		d, ok, err := e.ch.Get(e.sink, true)
		if err != nil {
			e.t.Fatal(err)
		}
		if !ok {
			return out
		}
		out = append(out, d)
	}
}

// Through the gateway to a real queue: every key's message arrives exactly
// once, with message_id = the key, whatever the retries and concurrent
// copies; a retry replays the 202.
func TestGatewayPublishesOncePerKey(t *testing.T) {
	t.Parallel()
	e := start(t, gateway.Config{})
	const keys, retries, copies = 10, 3, 5
	var (
		mu     sync.Mutex
		counts = map[string]int{}
	)
	count := func(a answer) {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case a.status == 202 && a.replayed:
			counts["replayed"]++
		default:
			counts[fmt.Sprint(a.status)]++
		}
	}
	for k := range keys {
		key := fmt.Sprintf("msg-%d", k)
		body := fmt.Sprintf(`{"payment":%d}`, k)
		first := e.post("/messages", key, "application/json", body)
		if first.status != 202 || first.body != `{"message_id":"`+key+`","status":"accepted"}`+"\n" {
			t.Fatalf("first request: %d %q", first.status, first.body)
		}
		for range retries {
			count(e.post("/messages", key, "application/json", body))
		}
		var wg sync.WaitGroup
		for range copies {
			wg.Go(func() { count(e.post("/messages", key, "application/json", body)) })
		}
		wg.Wait()
	}
	if counts["replayed"] != keys*(retries+copies) {
		t.Fatalf("answers %v: want every retry replayed", counts)
	}
	if a := e.post("/messages", "msg-0", "application/json", `{"payment":999}`); a.status != 422 {
		t.Fatalf("changed body: %d %s", a.status, a.body)
	}
	if a := e.post("/messages", "", "application/json", `{}`); a.status != 400 {
		t.Fatalf("missing key: %d %s", a.status, a.body)
	}
	resp, err := http.Get(e.url + "/healthz")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("healthz: %v %v", resp, err)
	}
	resp.Body.Close()

	got := e.drained()
	seen := map[string]int{}
	for _, d := range got {
		seen[d.MessageId]++
		if d.ContentType != "application/json" || !strings.HasPrefix(string(d.Body), `{"payment":`) {
			t.Errorf("message %s: %s %s", d.MessageId, d.ContentType, d.Body)
		}
	}
	if len(got) != keys || len(seen) != keys {
		t.Fatalf("%d messages, %d distinct ids (%v), want %d, one per key", len(got), len(seen), seen, keys)
	}
	for k := range keys {
		if n := seen[fmt.Sprintf("msg-%d", k)]; n != 1 {
			t.Fatalf("key msg-%d: %d messages", k, n)
		}
	}
}

// With a token file, the tenant is the token's: it scopes the key and
// travels in x-tenant-id; an unknown token is 401. The routing key comes
// from the query, where the configuration allows it.
func TestGatewayTenantsFromTokens(t *testing.T) {
	t.Parallel()
	e := start(t, gateway.Config{Tokens: map[string]string{"s3cret-a": "alice", "s3cret-b": "bob"}, RoutingKey: "default", AllowRoutingKeys: []string{"orders.*"}})
	if a := e.post("/messages", "k", "text/plain", "hi"); a.status != 401 {
		t.Fatalf("no token: %d", a.status)
	}
	if a := e.post("/messages", "k", "text/plain", "hi", "Authorization", "Bearer nope"); a.status != 401 {
		t.Fatalf("unknown token: %d", a.status)
	}
	a := e.post("/messages?routing_key=orders.created", "k", "text/plain", "from alice", "Authorization", "Bearer s3cret-a")
	b := e.post("/messages", "k", "text/plain", "from bob", "Authorization", "Bearer s3cret-b")
	if a.status != 202 || b.status != 202 || b.replayed {
		t.Fatalf("alice %d, bob %d (replayed %v): one key in two tenants is two messages", a.status, b.status, b.replayed)
	}
	got := e.drained()
	if len(got) != 2 {
		t.Fatalf("%d messages, want 2", len(got))
	}
	byTenant := map[any]amqp.Delivery{}
	for _, d := range got {
		byTenant[d.Headers["x-tenant-id"]] = d
	}
	if d := byTenant["alice"]; string(d.Body) != "from alice" || d.RoutingKey != "orders.created" || d.MessageId != "k" {
		t.Fatalf("alice's message: %q %s %s", d.Body, d.RoutingKey, d.MessageId)
	}
	if d := byTenant["bob"]; string(d.Body) != "from bob" || d.RoutingKey != "default" {
		t.Fatalf("bob's message: %q %s", d.Body, d.RoutingKey)
	}
}

func TestReadTokens(t *testing.T) {
	got, err := gateway.ReadTokens(strings.NewReader("# token tenant\n\ns3cret-a alice\n s3cret-b\tbob \n"))
	if err != nil || len(got) != 2 || got["s3cret-a"] != "alice" || got["s3cret-b"] != "bob" {
		t.Fatalf("tokens %v, %v", got, err)
	}
	for _, bad := range []string{"", "# only a comment\n", "one\n", "a x\na y\n", "a b c\n"} {
		if _, err := gateway.ReadTokens(strings.NewReader(bad)); err == nil {
			t.Errorf("%q: no error", bad)
		} else if strings.Contains(err.Error(), "s3cret") {
			t.Errorf("%q: the error shows a token", bad)
		}
	}
}

// Without tokens or with them, a request whose Host names another server
// (a page whose name an attacker rebinds to 127.0.0.1) gets 421 and runs
// nothing, on every route; the listen address, localhost and the names
// allowed by configuration are served.
func TestGatewayAnswersOnlyItsOwnHost(t *testing.T) {
	t.Parallel()
	open := start(t, gateway.Config{})
	withTokens := start(t, gateway.Config{Tokens: map[string]string{"s3cret-a": "alice"}})
	named := start(t, gateway.Config{AllowHosts: []string{"gw.example.com", "*.svc.cluster.local"}})
	bearer := []string{"Authorization", "Bearer s3cret-a"}
	for _, tc := range []struct {
		e    *env
		host string
		want int
	}{
		{open, "rebind.attacker.example", 421},
		{open, "rebind.attacker.example:80", 421},
		{withTokens, "rebind.attacker.example", 421},
		{named, "gw.example.org", 421},
		{open, "", 202},
		{open, "localhost", 202},
		{withTokens, "", 202},
		{named, "gw.example.com", 202},
		{named, "gateway.ns.svc.cluster.local:8080", 202},
	} {
		key := "host-" + hostKey(tc.host)
		headers := append([]string{"Host", cmp.Or(tc.host, tc.e.addr)}, bearer...)
		if a := tc.e.post("/messages", key, "text/plain", "hi", headers...); a.status != tc.want {
			t.Errorf("POST with Host %q: %d %s, want %d", tc.host, a.status, a.body, tc.want)
		}
		req, _ := http.NewRequest("GET", tc.e.url+"/healthz", nil)
		req.Host = cmp.Or(tc.host, tc.e.addr)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if want := map[int]int{421: 421, 202: 200}[tc.want]; resp.StatusCode != want {
			t.Errorf("GET /healthz with Host %q: %d, want %d", tc.host, resp.StatusCode, want)
		}
	}
	if n := len(open.drained()); n != 2 {
		t.Errorf("the open gateway published %d messages, want 2 (its own Host and localhost)", n)
	}
}

func hostKey(s string) string {
	return strings.NewReplacer(":", "-", ".", "-").Replace(cmp.Or(s, "self"))
}

// A request may name only a routing key the configuration allows (by
// default RoutingKey alone); another is refused with a problem body before
// its key is reserved, so the same key with an allowed routing key is a first
// request, not a reuse.
func TestGatewayRoutingKeysAreAllowedByConfiguration(t *testing.T) {
	t.Parallel()
	only := start(t, gateway.Config{RoutingKey: "payments", Middleware: idemhttp.Config{DocURL: "https://api.example.com/docs"}})
	for _, path := range []string{"/messages?routing_key=other-app", "/messages?routing_key=payments.dlq", "/messages?routing_key=%23"} {
		a := only.post(path, "k1", "text/plain", "hi")
		if a.status != 403 || !strings.Contains(a.body, `"code":"routing_key_not_allowed"`) ||
			!strings.Contains(a.body, `"type":"https://api.example.com/docs#routing_key_not_allowed"`) {
			t.Errorf("%s: %d %s, want 403 routing_key_not_allowed", path, a.status, a.body)
		}
	}
	if a := only.post("/messages?routing_key=payments&routing_key=other-app", "k1", "text/plain", "hi"); a.status != 400 {
		t.Errorf("routing_key twice: %d %s, want 400", a.status, a.body)
	}
	if a := only.post("/messages?routing_key="+strings.Repeat("a", 256), "k1", "text/plain", "hi"); a.status != 400 {
		t.Errorf("a 256-byte routing key: %d %s, want 400", a.status, a.body)
	}
	if a := only.post("/messages", "k1", "text/plain", "hi"); a.status != 202 || a.replayed {
		t.Errorf("the refused key with the allowed routing key: %d %s (replayed %v), want a first 202", a.status, a.body, a.replayed)
	}
	if a := only.post("/messages?routing_key=payments", "k2", "text/plain", "hi"); a.status != 202 {
		t.Errorf("?routing_key= naming RoutingKey: %d %s", a.status, a.body)
	}

	patterns := start(t, gateway.Config{RoutingKey: "orders.created", AllowRoutingKeys: []string{"orders.*", "audit.#"}})
	for rk, want := range map[string]int{
		"orders.paid": 202, "audit": 202, "audit.a.b": 202, "orders": 403,
		"orders.paid.eu": 403, "billing.orders.paid": 403, "x": 403,
	} {
		if a := patterns.post("/messages?routing_key="+rk, "k-"+rk, "text/plain", rk); a.status != want {
			t.Errorf("routing key %s: %d %s, want %d", rk, a.status, a.body, want)
		}
	}
	got := map[string]string{}
	for _, d := range patterns.drained() {
		got[string(d.Body)] = d.RoutingKey
	}
	if len(got) != 3 || got["orders.paid"] != "orders.paid" || got["audit"] != "audit" || got["audit.a.b"] != "audit.a.b" {
		t.Errorf("published %v, want the three allowed routing keys", got)
	}
	if n := len(only.drained()); n != 2 {
		t.Errorf("the gateway of one routing key published %d messages, want 2", n)
	}
}

// With the default exchange a request must name a queue: a request without
// a routing key, where the configuration names none, is refused.
func TestGatewayDefaultExchangeNeedsARoutingKey(t *testing.T) {
	t.Parallel()
	if _, err := gateway.New(deduptest.Store(t, testdb.Pool(t, 2), nil), gateway.Config{Consumer: "gw", Exchange: ""}); err == nil {
		t.Fatal("New accepted the default exchange without a routing key")
	}
	e := launch(t, gateway.Config{AllowRoutingKeys: []string{"gw.*.sink"}}, true)
	if a := e.post("/messages", "k", "text/plain", "hi"); a.status != 400 || !strings.Contains(a.body, "routing_key") {
		t.Errorf("no routing key on the default exchange: %d %s, want 400", a.status, a.body)
	}
	if a := e.post("/messages?routing_key="+e.sink, "k", "text/plain", "hi"); a.status != 202 || a.replayed {
		t.Errorf("the sink's name: %d %s", a.status, a.body)
	}
	if got := e.drained(); len(got) != 1 {
		t.Errorf("%d messages in the sink, want 1", len(got))
	}
}

// RFC 9110 §11.1: the authentication scheme is case-insensitive.
func TestGatewayBearerSchemeIgnoresCase(t *testing.T) {
	t.Parallel()
	e := start(t, gateway.Config{Tokens: map[string]string{"s3cret-a": "alice"}})
	for i, auth := range []string{"Bearer s3cret-a", "bearer s3cret-a", "BEARER s3cret-a", "bEaReR   s3cret-a"} {
		if a := e.post("/messages", fmt.Sprint("k", i), "text/plain", "hi", "Authorization", auth); a.status != 202 {
			t.Errorf("Authorization %q: %d %s, want 202", auth, a.status, a.body)
		}
	}
	for _, auth := range []string{"Basic s3cret-a", "Bearers3cret-a", "s3cret-a", "Bearer", "Bearer s3cret-b"} {
		if a := e.post("/messages", "k-bad", "text/plain", "hi", "Authorization", auth); a.status != 401 {
			t.Errorf("Authorization %q: %d %s, want 401", auth, a.status, a.body)
		}
	}
}

// A client that never finishes its body is cut after the read timeout:
// fifty of them do not keep fifty connections.
func TestGatewayCutsSlowBodies(t *testing.T) {
	t.Parallel()
	e := start(t, gateway.Config{ReadTimeout: 300 * time.Millisecond})
	const clients = 50
	var wg sync.WaitGroup
	for i := range clients {
		wg.Go(func() {
			c, err := net.Dial("tcp", e.addr)
			if err != nil {
				t.Error(err)
				return
			}
			defer c.Close()
			fmt.Fprintf(c, "POST /messages HTTP/1.1\r\nHost: %s\r\nIdempotency-Key: slow-%d\r\nContent-Type: text/plain\r\nContent-Length: 1000\r\n\r\nten bytes.", e.addr, i)
			_ = c.SetReadDeadline(time.Now().Add(15 * time.Second))
			if _, err := io.ReadAll(c); err != nil {
				t.Errorf("client %d: the connection is still open (%v): no read timeout", i, err)
			}
		})
	}
	wg.Wait()
}

// Connections beyond MaxClients wait until one of those served closes.
func TestGatewayCapsConnections(t *testing.T) {
	t.Parallel()
	e := start(t, gateway.Config{MaxClients: 2})
	healthz := func(c net.Conn) error {
		fmt.Fprintf(c, "GET /healthz HTTP/1.1\r\nHost: %s\r\n\r\n", e.addr)
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			return fmt.Errorf("healthz: %d", resp.StatusCode)
		}
		return nil
	}
	var held []net.Conn
	for range 2 {
		c, err := net.Dial("tcp", e.addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if err := healthz(c); err != nil {
			t.Fatal(err)
		}
		held = append(held, c) // kept alive, idle: it holds its place
	}
	third, err := net.Dial("tcp", e.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer third.Close()
	served := make(chan error, 1)
	go func() { served <- healthz(third) }()
	select {
	case err := <-served:
		t.Fatalf("a third connection was served beside two (%v): no cap", err)
	case <-time.After(500 * time.Millisecond):
	}
	held[0].Close()
	select {
	case err := <-served:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the third connection was not served after one of the two closed")
	}
}

// The gateway starts and accepts while the broker is out of reach; the
// relay publishes what it accepted once the broker is back.
func TestGatewayAcceptsWhileTheBrokerIsDown(t *testing.T) {
	t.Parallel()
	b := newLateBroker(t)
	e := start(t, gateway.Config{AMQPURL: b.url, Relay: outbox.RelayConfig{ReconnectMax: 200 * time.Millisecond}})
	for i := range 3 {
		if a := e.post("/messages", fmt.Sprint("down-", i), "text/plain", "while down"); a.status != 202 {
			t.Fatalf("request %d while the broker is down: %d %s", i, a.status, a.body)
		}
	}
	consumertest.WaitFor(t, 30*time.Second, "the relay to try the broker", func() bool { return b.refused.Load() > 0 })
	b.up.Store(true)
	var got int
	consumertest.WaitFor(t, 60*time.Second, "the three messages in the sink", func() bool {
		for {
			_, ok, err := e.ch.Get(e.sink, true)
			if err != nil {
				t.Fatal(err)
			}
			if !ok {
				return got == 3
			}
			got++
		}
	})
}

// lateBroker is an address that refuses every broker connection (it closes
// them as they come) until up, then forwards them to the test broker.
type lateBroker struct {
	url     string
	up      atomic.Bool
	refused atomic.Int64
}

func newLateBroker(t *testing.T) *lateBroker {
	t.Helper()
	u, err := url.Parse(testamqp.URL())
	if err != nil {
		t.Fatal(err)
	}
	target := u.Host
	if u.Port() == "" {
		target = net.JoinHostPort(u.Hostname(), "5672")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u.Host = ln.Addr().String()
	b := &lateBroker{url: u.String()}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns []net.Conn
	)
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if !b.up.Load() {
				b.refused.Add(1)
				c.Close()
				continue
			}
			up, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, c, up)
			mu.Unlock()
			wg.Go(func() { _, _ = io.Copy(up, c); up.Close() })
			wg.Go(func() { _, _ = io.Copy(c, up); c.Close() })
		}
	})
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return b
}

// A broker that refuses the relay's credentials is not a broker that is
// down: retrying does not heal it, and a gateway that went on accepting
// would fill an outbox nobody publishes. Serve stops with the relay's error.
func TestGatewayStopsWhenTheRelayGivesUp(t *testing.T) {
	t.Parallel()
	u, err := url.Parse(testamqp.URL())
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword("idemq-no-such-user", "wrong")
	discard := slog.New(slog.NewTextHandler(io.Discard, nil))
	g, err := gateway.New(deduptest.Store(t, testdb.Pool(t, 8), nil), gateway.Config{
		Consumer: "gateway", Exchange: "x", AMQPURL: u.String(), Logger: discard,
		Relay: outbox.RelayConfig{Logger: discard}, DrainTimeout: time.Minute,
	})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- g.Serve(ctx, ln) }()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("Serve returned nil while its relay was refused")
		}
	case <-time.After(30 * time.Second):
		cancel()
		<-done
		t.Fatal("the gateway went on serving with a relay that gave up")
	}
}

// The key is an sf-string: `"order-7"` is the key order-7, the same
// operation as a bare order-7, and the message's message_id is order-7
// without quotes.
func TestGatewayQuotedKeyIsTheBareKey(t *testing.T) {
	t.Parallel()
	e := start(t, gateway.Config{})
	first := e.post("/messages", `"order-7"`, "application/json", `{"order":7}`)
	if first.status != 202 || first.body != `{"message_id":"order-7","status":"accepted"}`+"\n" {
		t.Fatalf("quoted key: %d %q, want 202 with message_id order-7", first.status, first.body)
	}
	if again := e.post("/messages", "order-7", "application/json", `{"order":7}`); again.status != 202 || !again.replayed {
		t.Fatalf("bare key after the quoted one: %d replayed=%v, want the replayed 202", again.status, again.replayed)
	}
	got := e.drained()
	if len(got) != 1 || got[0].MessageId != "order-7" {
		ids := []string{}
		for _, d := range got {
			ids = append(ids, d.MessageId)
		}
		t.Fatalf("published message ids %q, want one order-7", ids)
	}
}
