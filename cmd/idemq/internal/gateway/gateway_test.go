package gateway_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/cmd/idemq/internal/gateway"
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
	url  string
	sink string
	ch   *amqp.Channel
	stop func()
}

func start(t *testing.T, cfg gateway.Config) *env {
	t.Helper()
	pool := testdb.Pool(t, 40)
	store := deduptest.Store(t, pool, nil)
	discard := slog.New(slog.NewTextHandler(io.Discard, nil))
	exchange := testamqp.Name(t, "gw")
	sink := exchange + ".sink"
	testamqp.DeleteQueuesAtCleanup(t, []string{sink}, []string{exchange})
	ch := testamqp.Channel(t, testamqp.Dial(t))
	testamqp.Sink(t, ch, exchange, amqp.ExchangeTopic, sink, "#")
	cfg.Consumer = "gateway"
	cfg.Exchange = exchange
	cfg.AMQPURL = testamqp.URL()
	cfg.Relay = outbox.RelayConfig{Logger: discard, ConnectionName: "idemq-test-" + exchange + "-relay"}
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
	return &env{t: t, url: "http://" + ln.Addr().String(), sink: sink, ch: ch, stop: stop}
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
// from the query.
func TestGatewayTenantsFromTokens(t *testing.T) {
	t.Parallel()
	e := start(t, gateway.Config{Tokens: map[string]string{"s3cret-a": "alice", "s3cret-b": "bob"}, RoutingKey: "default"})
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
