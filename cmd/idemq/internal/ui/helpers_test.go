package ui_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/cmd/idemq/internal/jaeger/jaegertest"
	"github.com/idemq/idemq/cmd/idemq/internal/ui"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/deduptest"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/internal/wire"
	"github.com/idemq/idemq/outbox"
)

func TestMain(m *testing.M) {
	code := m.Run()
	jaegertest.Stop()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// consumerName is the consumer scope of the test queues.
const consumerName = "payments"

// env is one test's world: a migrated schema, a work queue with its tiers
// and DLQ, and a UI over them.
type env struct {
	t      *testing.T
	pool   *pgxpool.Pool
	schema string
	store  *dedup.Store
	outbox *outbox.Outbox
	topo   consumer.Topology
	conn   *amqp.Connection
	ch     *amqp.Channel
	srv    *httptest.Server
	client *http.Client
	// cfg is the UI's config, for a test that starts another server on it.
	cfg ui.Config
}

func newEnv(t *testing.T, edit func(*ui.Config)) *env {
	t.Helper()
	pool := testdb.Pool(t, 8)
	e := &env{t: t, pool: pool, schema: deduptest.Schema(t, pool)}
	var err error
	if e.store, err = dedup.NewStore(pool, &dedup.Config{Schema: e.schema}); err != nil {
		t.Fatal(err)
	}
	if e.outbox, err = outbox.New(pool, &outbox.Config{Schema: e.schema}); err != nil {
		t.Fatal(err)
	}
	q := testamqp.Name(t, "idemq-test-ui")
	e.topo = consumer.NewTopology(consumer.TopologyConfig{Queue: q})
	names := []string{q, e.topo.DLQ}
	for _, d := range e.topo.Delays {
		names = append(names, e.topo.TierName(d))
	}
	testamqp.DeleteQueuesAtCleanup(t, names, []string{e.topo.DLX})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := consumer.Apply(ctx, testamqp.URL(), consumer.TopologyConfig{Queue: q}); err != nil {
		t.Fatalf("topology: %v", err)
	}
	e.conn = testamqp.Dial(t)
	e.ch = testamqp.Channel(t, e.conn)
	cfg := ui.Config{
		Pool: pool, Schema: e.schema,
		Dial: func() (*amqp.Connection, error) {
			return amqp.DialConfig(testamqp.URL(), testamqp.Config("idemq-test-ui"))
		},
		Queues: []ui.Queue{{Topology: e.topo, Consumer: consumerName}},
	}
	if edit != nil {
		edit(&cfg)
	}
	e.cfg = cfg
	s, err := ui.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.srv = httptest.NewServer(s)
	t.Cleanup(func() {
		e.srv.Close()
		s.Close(context.Background())
	})
	jar, _ := cookiejar.New(nil)
	e.client = &http.Client{Jar: jar, Timeout: 30 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error {
		return http.ErrUseLastResponse
	}}
	return e
}

// page is a response as a test reads it.
type page struct {
	code     int
	body     string
	location string
}

func (e *env) do(req *http.Request) page {
	e.t.Helper()
	resp, err := e.client.Do(req)
	if err != nil {
		e.t.Fatalf("%s %s: %v", req.Method, req.URL, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		e.t.Fatal(err)
	}
	return page{code: resp.StatusCode, body: string(b), location: resp.Header.Get("Location")}
}

func (e *env) get(path string) page {
	e.t.Helper()
	req, err := http.NewRequest(http.MethodGet, e.srv.URL+path, nil)
	if err != nil {
		e.t.Fatal(err)
	}
	return e.do(req)
}

// post sends form to path with the CSRF token of the browser's cookie
// (read from the page at /keys first when the test has none yet).
func (e *env) post(path string, form url.Values) page {
	e.t.Helper()
	if form.Get("csrf") == "" {
		form.Set("csrf", e.csrf())
	}
	return e.postRaw(path, form, nil)
}

func (e *env) postRaw(path string, form url.Values, header http.Header) page {
	e.t.Helper()
	req, err := http.NewRequest(http.MethodPost, e.srv.URL+path, strings.NewReader(form.Encode()))
	if err != nil {
		e.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	for k, v := range header {
		req.Header[k] = v
	}
	return e.do(req)
}

var (
	csrfInput = regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`)
	onceInput = regexp.MustCompile(`name="once" value="([0-9a-f]+)"`)
)

// csrf returns the CSRF token of the client's cookie, from a page's form.
func (e *env) csrf() string {
	e.t.Helper()
	p := e.get("/keys")
	m := csrfInput.FindStringSubmatch(p.body)
	if m == nil {
		e.t.Fatalf("no CSRF token in /keys (%d):\n%s", p.code, p.body)
	}
	return m[1]
}

func field(t *testing.T, re *regexp.Regexp, body string) string {
	t.Helper()
	m := re.FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("no %s in:\n%s", re, body)
	}
	return m[1]
}

// deadLetter publishes a dead letter to the DLQ as the consumer writes them.
func (e *env) deadLetter(key, reason, errText string, body []byte) {
	e.t.Helper()
	h := wire.DeadLetterHeaders(reason, errors.New(errText), 3)
	h[wire.HeaderOriginalExchange] = "payments-in"
	h[wire.HeaderOriginalRoutingKey] = "card.charge"
	h[wire.HeaderFirstSeen] = time.Now().UTC().Format(time.RFC3339Nano)
	testamqp.Publish(e.t, e.ch, "", e.topo.DLQ, amqp.Publishing{MessageId: key, Body: body, Headers: h, ContentType: "application/json"})
}

// ready is the number of ready messages in queue, waited for until it is want.
func (e *env) waitReady(queue string, want int) {
	e.t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		q, err := e.ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		if err != nil {
			e.t.Fatal(err)
		}
		if q.Messages == want {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("%s: %d ready, want %d", queue, q.Messages, want)
		}
		<-time.After(20 * time.Millisecond) // poll interval
	}
}

// complete reserves key and completes it with res.
func (e *env) complete(key string, res dedup.Result) {
	e.t.Helper()
	ctx := context.Background()
	fp, _ := dedup.BodyFingerprint([]byte(key))
	r, err := e.store.Reserve(ctx, dedup.Claim{Scope: dedup.Scope{Consumer: consumerName, Key: key}, Fingerprint: fp, TraceID: "4bf92f3577b34da6a3ce929d0e0e4736", SpanID: "00f067aa0ba902b7"})
	if err != nil || r.Decision != dedup.Acquired {
		e.t.Fatalf("reserve %s: %v %v", key, r.Decision, err)
	}
	err = pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return e.store.Complete(ctx, tx, r.Lease, res) })
	if err != nil {
		e.t.Fatal(err)
	}
}

func mustContain(t *testing.T, p page, wants ...string) {
	t.Helper()
	for _, w := range wants {
		if !strings.Contains(p.body, w) {
			t.Fatalf("page (%d) lacks %q:\n%s", p.code, w, p.body)
		}
	}
}

func mustNotContain(t *testing.T, p page, bad ...string) {
	t.Helper()
	for _, b := range bad {
		if strings.Contains(p.body, b) {
			t.Fatalf("page (%d) holds %q:\n%s", p.code, b, p.body)
		}
	}
}
