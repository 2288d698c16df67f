package cli

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/dedup/deduptest"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

// gatewayRun is `idemq gateway` running in this process.
type gatewayRun struct {
	addr   string
	stderr *lockedBuffer
	stop   func() int // ends the run and returns its exit code
}

var servingLog = regexp.MustCompile(`msg=serving .*addr=(\S+)`)

// runGateway runs `idemq gateway ARGS` against a fresh schema and waits
// until it serves; amqpURL is its broker.
func runGateway(t *testing.T, amqpURL string, args ...string) *gatewayRun {
	t.Helper()
	schema := deduptest.Schema(t, testdb.Pool(t, 2))
	ctx, cancel := context.WithCancel(context.Background())
	stderr := &lockedBuffer{}
	exited := make(chan struct{})
	code := -1
	all := append([]string{"gateway", "--postgres-url", testdb.URL(), "--amqp-url", amqpURL, "--schema", schema,
		"--listen", "127.0.0.1:0", "--consumer", "gw-cli", "--drain-timeout", "20s"}, args...)
	go func() {
		defer close(exited)
		code = Main(ctx, all, io.Discard, stderr)
	}()
	r := &gatewayRun{stderr: stderr, stop: func() int {
		cancel()
		select {
		case <-exited:
		case <-time.After(60 * time.Second):
			t.Errorf("the gateway did not exit within 60s of its context's end")
			return -1
		}
		return code
	}}
	t.Cleanup(func() { r.stop() })
	deadline := time.After(30 * time.Second)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if m := servingLog.FindStringSubmatch(stderr.String()); m != nil {
			r.addr = m[1]
			return r
		}
		select {
		case <-exited:
			t.Fatalf("idemq gateway exited %d before serving:\n%s", code, stderr.String())
		case <-deadline:
			t.Fatalf("idemq gateway did not serve within 30s:\n%s", stderr.String())
		case <-tick.C:
		}
	}
}

func (r *gatewayRun) post(t *testing.T, host, path, key string) (int, string) {
	t.Helper()
	req, err := http.NewRequest("POST", "http://"+r.addr+path, strings.NewReader(`{"amount":4990}`))
	if err != nil {
		t.Fatal(err)
	}
	if host != "" {
		req.Host = host
	}
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// The docs say a message is accepted whether or not the broker is up: the
// gateway starts while RabbitMQ refuses every connection, answers 202, and
// its relay publishes the message once the broker is back.
func TestGatewayStartsWhileTheBrokerIsDown(t *testing.T) {
	t.Parallel()
	q := testamqp.Name(t, "cli-gw-down")
	testamqp.DeleteQueuesAtCleanup(t, []string{q}, nil)
	ch := testamqp.Channel(t, testamqp.Dial(t))
	if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	b := newLateBroker(t)
	g := runGateway(t, b.url, "--to-exchange", "", "--routing-key", q)
	if code, body := g.post(t, "", "/messages", "k-down"); code != 202 {
		t.Fatalf("while the broker is down: %d %s", code, body)
	}
	consumertest.WaitFor(t, 30*time.Second, "the relay to try the broker", func() bool { return b.refused.Load() > 0 })
	b.up.Store(true)
	consumertest.WaitFor(t, 90*time.Second, "the message in "+q, func() bool {
		qi, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
		return err == nil && qi.Messages == 1
	})
	if code := g.stop(); code != ExitOK {
		t.Fatalf("exit %d:\n%s", code, g.stderr.String())
	}
	d, ok, err := ch.Get(q, true)
	if err != nil || !ok || d.MessageId != "k-down" {
		t.Fatalf("the message: %v %v %+v", ok, err, d)
	}
}

// --allow-host names the other hosts the gateway answers to (every other
// Host gets 421), --allow-routing-key the routing keys a request may name
// (every other gets 403).
func TestGatewayAllowFlags(t *testing.T) {
	t.Parallel()
	exchange := testamqp.Name(t, "cli-gw-allow")
	testamqp.DeleteQueuesAtCleanup(t, []string{exchange + ".sink"}, []string{exchange})
	ch := testamqp.Channel(t, testamqp.Dial(t))
	testamqp.Sink(t, ch, exchange, "topic", exchange+".sink", "#")
	g := runGateway(t, testamqp.URL(), "--to-exchange", exchange, "--routing-key", "orders.created",
		"--allow-host", "gw.example.com,*.svc.cluster.local", "--allow-host", "gw2.example.com",
		"--allow-routing-key", "orders.*", "--allow-routing-key", "audit.#",
		"--read-timeout", "5s", "--max-clients", "8")
	for i, tc := range []struct {
		host, path string
		want       int
	}{
		{"", "/messages", 202},
		{"gw.example.com", "/messages", 202},
		{"gw2.example.com:8080", "/messages", 202},
		{"api.ns.svc.cluster.local", "/messages", 202},
		{"rebind.attacker.example", "/messages", 421},
		{"", "/messages?routing_key=orders.paid", 202},
		{"", "/messages?routing_key=audit.x.y", 202},
		{"", "/messages?routing_key=other-app", 403},
		{"", "/messages?routing_key=orders.paid.eu", 403},
	} {
		if code, body := g.post(t, tc.host, tc.path, fmt.Sprint("k", i)); code != tc.want {
			t.Errorf("Host %q, %s: %d %s, want %d", tc.host, tc.path, code, body, tc.want)
		}
	}
}

func TestGatewayFlagsAreChecked(t *testing.T) {
	t.Parallel()
	base := []string{"gateway", "--consumer", "c", "--to-exchange", "x", "--postgres-url", "postgres://u:secret@127.0.0.1:1/x"}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--max-clients", "0"}, "--max-clients"},
		{[]string{"--read-timeout", "0s"}, "--read-timeout"},
		{[]string{"--allow-host", "http://gw.example.com"}, "allow"},
		{[]string{"--allow-routing-key", "orders*"}, "--allow-routing-key"},
		{[]string{"--to-exchange", ""}, "--routing-key"},
	} {
		var stderr bytes.Buffer
		if code := Main(context.Background(), append(append([]string{}, base...), tc.args...), io.Discard, &stderr); code != ExitUsage || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("%v: exit %d, want %d naming %s:\n%s", tc.args, code, ExitUsage, tc.want, stderr.String())
		}
	}
	// With --allow-routing-key the default exchange needs no --routing-key:
	// each request names its queue.
	var stderr bytes.Buffer
	args := append(append([]string{}, base...), "--to-exchange", "", "--allow-routing-key", "app.*", "--connect-timeout", "1s")
	if code := Main(context.Background(), args, io.Discard, &stderr); code != ExitFailure || !strings.Contains(stderr.String(), "Postgres") {
		t.Errorf("default exchange with --allow-routing-key: exit %d, want %d (Postgres out of reach):\n%s", code, ExitFailure, stderr.String())
	}
}

// lockedBuffer is a bytes.Buffer that a running command writes while the
// test reads it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
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
