package integration

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/deduptest"
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/internal/testenv"
	"github.com/idemq/idemq/outbox"
)

// ---------------------------------------------------------------- (a) roles

// TestLeastPrivilegeWorkerRole runs the setup of docs/security.md: an owner
// role migrates the schema, a worker role with only USAGE on the schema and
// SELECT/INSERT/UPDATE/DELETE on its tables runs a consumer (handler,
// outbox, relay, GC) and cannot change the schema.
func TestLeastPrivilegeWorkerRole(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := testdb.Pool(t, 4)
	suffix := testdb.RandomHex(4)
	owner, worker := "idemq_owner_"+suffix, "idemq_worker_"+suffix
	schemaName := testdb.Schema(t, admin)
	dbName := currentDatabase(t, admin)
	mustExec(t, admin, fmt.Sprintf(`CREATE ROLE %s LOGIN PASSWORD 'owner-pw'; CREATE ROLE %s LOGIN PASSWORD 'worker-pw';
GRANT CREATE ON DATABASE %s TO %s`, owner, worker, pgx.Identifier{dbName}.Sanitize(), owner))
	t.Cleanup(func() {
		// After the schema is dropped (cleanups run last in, first out).
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, testdb.URL())
		if err != nil {
			t.Logf("drop roles: %v", err)
			return
		}
		defer conn.Close(ctx)
		for _, r := range []string{worker, owner} {
			_, err := conn.Exec(ctx, fmt.Sprintf(`DROP SCHEMA IF EXISTS %s CASCADE; DROP OWNED BY %s; DROP ROLE %s`,
				pgx.Identifier{schemaName}.Sanitize(), r, r))
			if err != nil {
				t.Logf("drop role %s: %v", r, err)
			}
		}
	})

	// The owner migrates and grants, as docs/security.md says.
	ownerPool := poolAs(t, owner, "owner-pw")
	if err := schema.Migrate(ctx, ownerPool, schemaName); err != nil {
		t.Fatalf("migrate as the owner: %v", err)
	}
	s := pgx.Identifier{schemaName}.Sanitize()
	mustExec(t, ownerPool, fmt.Sprintf(`
CREATE TABLE %[1]s.ledger (key text NOT NULL, tenant text NOT NULL);
GRANT USAGE ON SCHEMA %[1]s TO %[2]s;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA %[1]s TO %[2]s;
ALTER DEFAULT PRIVILEGES IN SCHEMA %[1]s GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO %[2]s;`, s, worker))

	// The worker runs everything a worker runs.
	workerPool := poolAs(t, worker, "worker-pw")
	store, err := dedup.NewStore(workerPool, &dedup.Config{Schema: schemaName})
	if err != nil {
		t.Fatal(err)
	}
	e := &testenv.Env{TB: t, Pool: workerPool, Schema: schemaName, Store: store, Pub: testamqp.Channel(t, testamqp.Dial(t))}
	cfg, events := e.ConsumerConfig("it.role", "payments")
	outQ := cfg.Queue + ".forwarded"
	declareQueue(t, outQ)
	e.Run(cfg, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		if _, err := tx.Exec(ctx, "INSERT INTO "+s+".ledger VALUES ($1, $2)", d.Key, d.Tenant); err != nil {
			return consumer.Response{}, err
		}
		return consumer.Response{Code: 201}, outbox.Enqueue(ctx, tx, outbox.Message{RoutingKey: outQ, Body: d.Body})
	})
	ob, err := outbox.New(workerPool, &outbox.Config{Schema: schemaName})
	if err != nil {
		t.Fatal(err)
	}
	relay, err := outbox.NewRelay(ob, testamqp.URL(), &outbox.RelayConfig{
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), ConnectionName: "idemq-test-" + cfg.Queue + "-relay",
	})
	if err != nil {
		t.Fatal(err)
	}
	e.RunFunc(relay.Run)
	e.Publish(cfg.Queue, "role-1", `{"amount":1}`, nil)
	testenv.WaitOutcome(t, events, consumer.OutcomeProcessed)
	e.Publish(cfg.Queue, "role-1", `{"amount":1}`, nil)
	testenv.WaitOutcome(t, events, consumer.OutcomeDuplicate)
	e.Publish(cfg.Queue, "role-2", `{"amount":2}`, amqp.Table{consumer.DefaultTenantHeader: "acme"})
	testenv.WaitOutcome(t, events, consumer.OutcomeProcessed)
	waitMessages(t, outQ, 2)
	if _, err := store.GC(ctx, dedup.GCOptions{Retention: time.Hour}); err != nil {
		t.Fatalf("gc as the worker: %v", err)
	}

	// And cannot change the schema.
	for _, ddl := range []string{
		"CREATE TABLE " + s + ".evil (x int)",
		"DROP TABLE " + s + ".keys",
		"ALTER TABLE " + s + ".keys ADD COLUMN evil int",
		"TRUNCATE " + s + ".keys",
		"CREATE SCHEMA evil_" + suffix,
		"CREATE INDEX evil ON " + s + ".keys (created_at)",
	} {
		_, err := workerPool.Exec(ctx, ddl)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
			t.Errorf("%s as the worker: %v, want permission denied (42501)", ddl, err)
		}
	}
	if err := schema.Migrate(ctx, workerPool, schemaName); err == nil {
		t.Error("migrate as the worker succeeded; it must need the owner")
	}
}

func currentDatabase(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	var name string
	if err := pool.QueryRow(context.Background(), "SELECT current_database()").Scan(&name); err != nil {
		t.Fatal(err)
	}
	return name
}

func mustExec(t *testing.T, pool *pgxpool.Pool, sql string) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), sql); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// poolAs opens a pool on the test database as another role.
func poolAs(t *testing.T, user, password string) *pgxpool.Pool {
	t.Helper()
	u, err := url.Parse(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(user, password)
	pool, err := pgxpool.New(context.Background(), u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// declareQueue declares a queue for the test and deletes it at the end.
func declareQueue(t *testing.T, name string) {
	t.Helper()
	ch, err := testamqp.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if _, err := ch.QueueDeclare(name, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	testamqp.DeleteQueuesAtCleanup(t, []string{name}, nil)
}

// waitMessages waits until queue holds n ready messages.
func waitMessages(t *testing.T, queue string, n int) {
	t.Helper()
	ch, err := testamqp.Dial(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	deadline := time.Now().Add(30 * time.Second)
	for {
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		if q.Messages >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("queue %s holds %d messages after 30s, want %d", queue, q.Messages, n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// ---------------------------------------------------------------- (b) TLS

// TestAMQPTLSConfigReachesTheDialer dials amqps:// at a TLS listener that
// records the handshake: the server name, the client certificate and the
// trusted roots of Config.AMQPConfig.TLSClientConfig are the ones used.
func TestAMQPTLSConfigReachesTheDialer(t *testing.T) {
	t.Parallel()
	ca, caKey := newCA(t)
	serverCert := issue(t, ca, caKey, "broker.idemq.test", false)
	clientCert := issue(t, ca, caKey, "idemq-worker", true)
	roots := x509.NewCertPool()
	roots.AddCert(ca)

	type hello struct {
		serverName string
		clientCN   string
	}
	seen := make(chan hello, 4)
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		Certificates: []tls.Certificate{serverCert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    roots,
		MinVersion:   tls.VersionTLS12,
		VerifyConnection: func(cs tls.ConnectionState) error {
			h := hello{serverName: cs.ServerName}
			if len(cs.PeerCertificates) > 0 {
				h.clientCN = cs.PeerCertificates[0].Subject.CommonName
			}
			seen <- h
			return nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			// Handshake, then hang up: no AMQP here, only TLS.
			_ = conn.(*tls.Conn).Handshake()
			_ = conn.Close()
		}
	}()

	cfg := consumer.Config{
		URL:   "amqps://guest:guest@" + ln.Addr().String() + "/",
		Queue: "tls-check", Name: "tls-check",
		AMQPConfig: &amqp.Config{TLSClientConfig: &tls.Config{
			ServerName:   "broker.idemq.test",
			RootCAs:      roots,
			Certificates: []tls.Certificate{clientCert},
			MinVersion:   tls.VersionTLS12,
		}},
	}
	if err := consumer.Apply(t.Context(), cfg.URL, cfg.TopologyConfig()); err == nil {
		t.Fatal("apply against a TLS listener that speaks no AMQP succeeded")
	}
	select {
	case h := <-seen:
		if h.serverName != "broker.idemq.test" || h.clientCN != "idemq-worker" {
			t.Fatalf("handshake saw server name %q and client %q; the TLS config was not used", h.serverName, h.clientCN)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no TLS handshake completed: the dialer did not use the client certificate and roots")
	}
}

func newCA(t *testing.T) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "idemq test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert, key
}

func issue(t *testing.T, ca *x509.Certificate, caKey *ecdsa.PrivateKey, name string, client bool) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	usage := x509.ExtKeyUsageServerAuth
	if client {
		usage = x509.ExtKeyUsageClientAuth
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage},
	}
	if !client {
		tmpl.DNSNames = []string{name}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// ---------------------------------------------------------------- (c) URLs

// captured is a slog handler's output, safe to read while it is written.
type captured struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (c *captured) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.buf.Write(p)
}

func (c *captured) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.buf.String()
}

func (c *captured) logger() *slog.Logger {
	return slog.New(slog.NewJSONHandler(c, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// waitLog waits until the captured output holds n lines containing what.
func (c *captured) waitLog(t *testing.T, what string, n int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for strings.Count(c.String(), what) < n {
		if time.Now().After(deadline) {
			t.Fatalf("no %d log lines with %q after 30s; got:\n%s", n, what, c.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// closedPort returns a local port nothing listens on.
func closedPort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	return addr
}

// assertNoSecret fails when text carries the password, raw or URL-encoded.
func assertNoSecret(t *testing.T, where, text string, secrets ...string) {
	t.Helper()
	for _, s := range secrets {
		if strings.Contains(text, "s3cr3t") || strings.Contains(text, s) || strings.Contains(text, url.QueryEscape(s)) || strings.Contains(text, url.PathEscape(s)) {
			t.Errorf("%s carries a password:\n%s", where, text)
		}
	}
}

// TestConnectionURLsRedacted provokes connection errors with passwords in
// the URLs (a closed port, a refused login) and checks every log line and
// error text of the consumer, the key store and the outbox.
func TestConnectionURLsRedacted(t *testing.T) {
	t.Parallel()
	const amqpSecret, pgSecret, relaySecret = "amqp-s3cr3t/@:pw", "pg-s3cr3t/@:pw", "relay-s3cr3t/@:pw"
	secrets := []string{amqpSecret, pgSecret, relaySecret}
	amqpURL := func(addr, pw string) string {
		return (&url.URL{Scheme: "amqp", User: url.UserPassword("idemq", pw), Host: addr, Path: "/"}).String()
	}
	logs := &captured{}
	ctx := context.Background()

	t.Run("consumer, closed port", func(t *testing.T) {
		cfg := consumer.Config{URL: amqpURL(closedPort(t), amqpSecret), Queue: "redact", Name: "redact", Logger: logs.logger()}
		if err := consumer.Apply(ctx, cfg.URL, cfg.TopologyConfig()); err == nil {
			t.Fatal("apply against a closed port succeeded")
		} else {
			assertNoSecret(t, "consumer.Apply error", err.Error(), secrets...)
		}
		c := idleConsumer(t, &cfg)
		// The outage is logged once when it starts, then at most every 30 s.
		runFor(t, c.Run, func() { logs.waitLog(t, "never connected yet", 1) })
	})

	t.Run("consumer, wrong password", func(t *testing.T) {
		u, err := url.Parse(testamqp.URL())
		if err != nil {
			t.Fatal(err)
		}
		u.User = url.UserPassword(u.User.Username(), amqpSecret)
		cfg := consumer.Config{URL: u.String(), Queue: "redact", Name: "redact-pw", Logger: logs.logger()}
		c := idleConsumer(t, &cfg)
		// A refused login is not retried: Run returns it.
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		err = c.Run(ctx)
		if err == nil || ctx.Err() != nil {
			t.Fatalf("Run with a wrong password: %v; want the broker's refusal at once", err)
		}
		assertNoSecret(t, "consumer.Run error", err.Error(), secrets...)
		assertNoSecret(t, "consumer.Ready error", c.Ready().Error(), secrets...)
	})

	t.Run("key store, unreachable Postgres", func(t *testing.T) {
		pgURL := (&url.URL{Scheme: "postgres", User: url.UserPassword("postgres", pgSecret), Host: closedPort(t), Path: "/test", RawQuery: "sslmode=disable&connect_timeout=2"}).String()
		pool, err := pgxpool.New(ctx, pgURL)
		if err != nil {
			assertNoSecret(t, "pgxpool.New error", err.Error(), secrets...)
			return
		}
		defer pool.Close()
		if err := schema.Migrate(ctx, pool, "idemq_redact"); err == nil {
			t.Fatal("migrate against a closed port succeeded")
		} else {
			assertNoSecret(t, "schema.Migrate error", err.Error(), secrets...)
		}
		store, err := dedup.NewStore(pool, nil)
		if err != nil {
			t.Fatal(err)
		}
		_, err = store.Reserve(ctx, dedup.Claim{Scope: dedup.Scope{Consumer: "c", Key: "k"}})
		if err == nil {
			t.Fatal("reserve against a closed port succeeded")
		}
		assertNoSecret(t, "dedup.Reserve error", err.Error(), secrets...)
		if _, err := store.GC(ctx, dedup.GCOptions{Retention: time.Hour}); err != nil {
			assertNoSecret(t, "dedup.GC error", err.Error(), secrets...)
		}
	})

	t.Run("outbox relay, closed ports", func(t *testing.T) {
		anyOutbox, err := outbox.New(testdb.Pool(t, 2), nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := outbox.NewRelay(anyOutbox, "amqp://idemq:"+relaySecret+"@[::1", nil); err == nil {
			t.Fatal("a malformed URL was accepted")
		} else {
			assertNoSecret(t, "outbox.NewRelay error", err.Error(), secrets...)
		}
		pgURL := (&url.URL{Scheme: "postgres", User: url.UserPassword("postgres", pgSecret), Host: closedPort(t), Path: "/test", RawQuery: "sslmode=disable&connect_timeout=2"}).String()
		pool, err := pgxpool.New(ctx, pgURL)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		ob, err := outbox.New(pool, nil)
		if err != nil {
			t.Fatal(err)
		}
		relay, err := outbox.NewRelay(ob, amqpURL(closedPort(t), relaySecret), &outbox.RelayConfig{
			Logger: logs.logger(), ReconnectInitial: 10 * time.Millisecond, ReconnectMax: 50 * time.Millisecond,
		})
		if err != nil {
			t.Fatal(err)
		}
		// The outage is logged once when it starts, then at most every 30 s.
		before := strings.Count(logs.String(), "outbox relay")
		runFor(t, relay.Run, func() { logs.waitLog(t, "outbox relay", before+1) })
		if _, err := ob.Pending(ctx); err != nil {
			assertNoSecret(t, "outbox.Pending error", err.Error(), secrets...)
		}
	})

	assertNoSecret(t, "the logs", logs.String(), secrets...)
	if !strings.Contains(logs.String(), "xxxxx") && !strings.Contains(logs.String(), "refused") {
		t.Errorf("the logs say nothing of the failures:\n%s", logs.String())
	}
}

// runFor runs fn until until returns, then stops it and waits for it.
func runFor(t *testing.T, fn func(context.Context) error, until func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	until()
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("run: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("did not stop within 30s")
	}
}

// ---------------------------------------------------------------- (d) keys

// TestRawKeysStayOutOfLogsAndSpans takes messages to every outcome and
// checks every span (names, attributes, events, links, status) and every
// log line: no raw key anywhere, unless LogKeys.
func TestRawKeysStayOutOfLogsAndSpans(t *testing.T) {
	t.Parallel()
	for _, logKeys := range []bool{false, true} {
		t.Run(fmt.Sprintf("LogKeys=%v", logKeys), func(t *testing.T) {
			t.Parallel()
			testRawKeys(t, logKeys)
		})
	}
}

func testRawKeys(t *testing.T, logKeys bool) {
	e := testenv.New(t)
	prefix := "RAWKEY-" + testdb.RandomHex(4) + "-alice@example.com"
	key := func(n string) string { return prefix + "-" + n }
	recorder := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(recorder))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	logs := &captured{}
	cfg, events := e.ConsumerConfig("it.rawkeys", "payments")
	cfg.TracerProvider, cfg.Logger, cfg.LogKeys = tp, logs.logger(), logKeys
	if _, err := e.Pool.Exec(context.Background(), "CREATE TABLE "+e.Schema+".ledger (key text)"); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	failed := map[string]bool{}
	e.Run(cfg, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		switch {
		case strings.HasSuffix(d.Key, "-poison"):
			return consumer.Response{}, consumer.Permanent(errors.New("undecodable payment"))
		case strings.HasSuffix(d.Key, "-flaky"):
			mu.Lock()
			first := !failed[d.Key]
			failed[d.Key] = true
			mu.Unlock()
			if first {
				return consumer.Response{}, errors.New("card network timed out")
			}
		case strings.HasSuffix(d.Key, "-reject"):
			return consumer.Response{}, consumer.Reject(402, "insufficient funds", nil)
		}
		_, err := tx.Exec(ctx, "INSERT INTO "+e.Schema+".ledger VALUES ($1)", d.Key)
		return consumer.Response{Code: 201}, err
	})
	e.Publish(cfg.Queue, key("ok"), `{"amount":1}`, nil)
	testenv.WaitOutcome(t, events, consumer.OutcomeProcessed)
	e.Publish(cfg.Queue, key("ok"), `{"amount":1}`, nil)
	testenv.WaitOutcome(t, events, consumer.OutcomeDuplicate)
	e.Publish(cfg.Queue, key("ok"), `{"amount":2}`, nil)
	testenv.WaitOutcome(t, events, consumer.OutcomeKeyReuse)
	e.Publish(cfg.Queue, "", `{"amount":3}`, amqp.Table{consumer.DefaultKeyHeader: key("flaky")})
	testenv.WaitOutcome(t, events, consumer.OutcomeRetried)
	testenv.WaitOutcome(t, events, consumer.OutcomeProcessed)
	e.Publish(cfg.Queue, key("poison"), `{"amount":4}`, nil)
	testenv.WaitOutcome(t, events, consumer.OutcomeDeadLettered)
	e.Publish(cfg.Queue, key("reject"), `{"amount":5}`, nil)
	testenv.WaitOutcome(t, events, consumer.OutcomeRejected)
	e.Publish(cfg.Queue, "", `{"amount":6}`, amqp.Table{consumer.DefaultKeyHeader: key("bell\x07")})
	testenv.WaitOutcome(t, events, consumer.OutcomeInvalidKey)
	e.Publish(cfg.Queue, "", `{"amount":7}`, amqp.Table{consumer.DefaultKeyHeader: prefix + strings.Repeat("-long", 60)})
	testenv.WaitOutcome(t, events, consumer.OutcomeInvalidKey)

	spans := recorder.Ended()
	if len(spans) < 10 {
		t.Fatalf("only %d spans recorded", len(spans))
	}
	var text strings.Builder
	kv := func(attrs []attribute.KeyValue) {
		for _, a := range attrs {
			fmt.Fprintf(&text, " %s=%s", a.Key, a.Value.Emit())
		}
	}
	for _, s := range spans {
		fmt.Fprintf(&text, "span %q status %q", s.Name(), s.Status().Description)
		kv(s.Attributes())
		for _, ev := range s.Events() {
			fmt.Fprintf(&text, " event %q", ev.Name)
			kv(ev.Attributes)
		}
		for _, l := range s.Links() {
			kv(l.Attributes)
		}
		text.WriteByte('\n')
	}
	if logKeys {
		if !strings.Contains(text.String(), "idemq.key="+key("ok")) {
			t.Errorf("LogKeys: no span carries the raw key as idemq.key:\n%s", text.String())
		}
		return
	}
	if strings.Contains(text.String(), prefix) {
		t.Errorf("a span carries a raw key:\n%s", grep(text.String(), prefix))
	}
	if strings.Contains(logs.String(), prefix) {
		t.Errorf("a log line carries a raw key:\n%s", grep(logs.String(), prefix))
	}
	if !strings.Contains(logs.String(), "key_hash") {
		t.Errorf("the logs name no key hash (no dead letter logged?):\n%s", logs.String())
	}
}

func grep(text, what string) string {
	var out []string
	for _, line := range strings.Split(text, "\n") {
		if strings.Contains(line, what) {
			out = append(out, line)
		}
	}
	return strings.Join(out, "\n")
}

// ---------------------------------------------------------------- (e) tenants

// TestTenantIsolationEndToEnd publishes the same key under several tenants
// through a real consumer: each tenant's operation is its own (no duplicate,
// no key reuse across tenants), a tenant cannot read another's key, and with
// TenantFromUserID a forged tenant header is ignored.
func TestTenantIsolationEndToEnd(t *testing.T) {
	t.Parallel()
	e := testenv.New(t)
	ctx := context.Background()
	if _, err := e.Pool.Exec(ctx, "CREATE TABLE "+e.Schema+".ledger (key text, tenant text, body text)"); err != nil {
		t.Fatal(err)
	}
	handler := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		_, err := tx.Exec(ctx, "INSERT INTO "+e.Schema+".ledger VALUES ($1, $2, $3)", d.Key, d.Tenant, string(d.Body))
		return consumer.Response{Code: 201, Body: []byte("for " + d.Tenant)}, err
	}
	cfg, events := e.ConsumerConfig("it.tenants", "payments")
	e.Run(cfg, handler)
	tenant := func(t string) amqp.Table { return amqp.Table{consumer.DefaultTenantHeader: t} }

	e.Publish(cfg.Queue, "shared-op", `{"amount":100}`, tenant("tenant-a"))
	testenv.WaitOutcome(t, events, consumer.OutcomeProcessed)
	// The same key and another body in tenant b: its own operation, not a reuse.
	e.Publish(cfg.Queue, "shared-op", `{"amount":999}`, tenant("tenant-b"))
	testenv.WaitOutcome(t, events, consumer.OutcomeProcessed)
	// The same key and body in the default tenant: not a duplicate of a's.
	e.Publish(cfg.Queue, "shared-op", `{"amount":100}`, nil)
	testenv.WaitOutcome(t, events, consumer.OutcomeProcessed)
	// Within a tenant, the key keeps its meaning.
	e.Publish(cfg.Queue, "shared-op", `{"amount":100}`, tenant("tenant-a"))
	testenv.WaitOutcome(t, events, consumer.OutcomeDuplicate)
	e.Publish(cfg.Queue, "shared-op", `{"amount":100}`, tenant("tenant-b"))
	testenv.WaitOutcome(t, events, consumer.OutcomeKeyReuse)

	rows, err := e.Pool.Query(ctx, "SELECT tenant, body FROM "+e.Schema+".ledger ORDER BY tenant")
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (string, error) {
		var tn, body string
		err := r.Scan(&tn, &body)
		return tn + ":" + body, err
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{`:{"amount":100}`, `tenant-a:{"amount":100}`, `tenant-b:{"amount":999}`}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("effects %q, want %q", got, want)
	}
	// Each tenant reads only its own row, with its own response.
	for _, tn := range []string{"tenant-a", "tenant-b"} {
		rec, err := e.Store.Inspect(ctx, dedup.Scope{Consumer: "payments", Tenant: tn, Key: "shared-op"})
		if err != nil || rec.Tenant != tn || string(rec.Result.Response) != "for "+tn {
			t.Fatalf("inspect %s: %+v, %v", tn, rec, err)
		}
	}
	if _, err := e.Store.Inspect(ctx, dedup.Scope{Consumer: "payments", Tenant: "tenant-c", Key: "shared-op"}); !errors.Is(err, dedup.ErrNotFound) {
		t.Fatalf("inspect from tenant-c: %v, want ErrNotFound", err)
	}

	// With TenantFromUserID the tenant is the user RabbitMQ checked, not the header.
	cfg2, events2 := e.ConsumerConfig("it.tenants.userid", "payments-userid")
	cfg2.TenantFromUserID = true
	e.Run(cfg2, handler)
	user := "guest"
	if u, err := url.Parse(testamqp.URL()); err == nil && u.User != nil {
		user = u.User.Username()
	}
	testamqp.Publish(t, e.Pub, "", cfg2.Queue, amqp.Publishing{
		MessageId: "spoof-op", UserId: user, Body: []byte(`{"amount":1}`), Headers: tenant("tenant-a"),
	})
	ev := testenv.WaitOutcome(t, events2, consumer.OutcomeProcessed)
	if ev.Tenant != user {
		t.Fatalf("tenant %q, want the publishing user %q (the header said tenant-a)", ev.Tenant, user)
	}
}

// idleConsumer is a consumer of cfg whose handler does nothing, on a store
// of its own (a migrated schema): for tests of what it logs while it cannot
// connect.
func idleConsumer(t *testing.T, cfg *consumer.Config) *consumer.Consumer {
	t.Helper()
	store := deduptest.Store(t, testdb.Pool(t, 2), nil)
	c, err := consumer.New(store, func(context.Context, pgx.Tx, *consumer.Delivery) (consumer.Response, error) {
		return consumer.Response{}, nil
	}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}
