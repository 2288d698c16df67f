package main_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

func TestBadUsageExits2(t *testing.T) {
	t.Parallel()
	environ := env("idemq")
	for _, tc := range []struct {
		name string
		args []string
		env  []string
		want string
	}{
		{"unknown command", []string{"frobnicate"}, nil, `unknown command "frobnicate"`},
		{"unknown subcommand", []string{"dlq", "frobnicate"}, nil, `unknown command "frobnicate"`},
		{"unknown flag", []string{"migrate", "--bogus"}, nil, "unknown flag: --bogus"},
		{"missing required flag", []string{"forward", "--queue", "q", "--consumer", "c"}, nil, `"to-exchange" not set`},
		{"malformed duration", []string{"gc", "--retention", "soon"}, nil, "invalid argument"},
		{"malformed number", []string{"dlq", "list", "--queue", "q", "--limit", "many"}, nil, "invalid argument"},
		{"invalid value", []string{"forward", "--queue", "q", "--consumer", "c", "--to-exchange", "x", "--concurrency", "0"}, nil, "--concurrency 0"},
		{"unknown key preset", []string{"forward", "--queue", "q", "--consumer", "c", "--to-exchange", "x", "--key-from", "rebus"}, nil, "--key-from"},
		{"relay batch out of range", []string{"forward", "--queue", "q", "--consumer", "c", "--to-exchange", "x", "--relay-batch-size", "0"}, nil, "--relay-batch-size 0"},
		{"forward to itself", []string{"forward", "--queue", "q", "--consumer", "c", "--to-exchange", ""}, nil, "--to-routing-key"},
		{"header keys file without a key", []string{"forward", "--queue", "q", "--consumer", "c", "--to-exchange", "x", "--header-keys-file", os.DevNull}, nil, "holds no key"},
		{"header keys file from env", []string{"forward", "--queue", "q", "--consumer", "c", "--to-exchange", "x"}, []string{"IDEMQ_HEADER_KEYS_FILE=" + os.DevNull}, "IDEMQ_HEADER_KEYS_FILE"},
		{"gateway on all interfaces without tokens", []string{"gateway", "--consumer", "c", "--to-exchange", "x", "--listen", ":8080"}, nil, "not a loopback address"},
		{"gateway tokens and tenant header", []string{"gateway", "--consumer", "c", "--to-exchange", "x", "--tokens", os.DevNull, "--tenant-header", "x-tenant-id"}, nil, "exclude each other"},
		{"gateway empty tokens file", []string{"gateway", "--consumer", "c", "--to-exchange", "x", "--tokens", os.DevNull}, nil, "no token"},
		{"key missing", []string{"keys", "inspect", "--consumer", "c"}, nil, "exactly one KEY"},
		{"stray argument", []string{"migrate", "now"}, nil, "takes no arguments"},
		{"bad schema", []string{"migrate", "--schema", "Bad-Name"}, nil, "--schema"},
		{"bad log level", []string{"version", "--log-level", "loud"}, nil, "--log-level"},
		{"bad env value", []string{"version"}, []string{"IDEMQ_CONNECT_TIMEOUT=forever"}, "IDEMQ_CONNECT_TIMEOUT"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := idemq(t, append(environ, tc.env...), tc.args...)
			if r.code != 2 {
				t.Fatalf("want exit 2: %s", r)
			}
			if !strings.HasPrefix(r.stderr, "idemq: ") || !strings.Contains(r.stderr, tc.want) {
				t.Fatalf("want a one-line message with %q: %s", tc.want, r)
			}
		})
	}
}

func TestFlagsWinOverEnvironment(t *testing.T) {
	t.Parallel()
	schema := newSchema(t)
	// The environment is used when no flag is given...
	r := idemq(t, env(schema, "IDEMQ_POSTGRES_URL=postgres://u:pw@127.0.0.1:1/x"), "migrate")
	if r.code != 1 || !strings.Contains(r.stderr, "127.0.0.1:1") {
		t.Fatalf("IDEMQ_POSTGRES_URL not used: %s", r)
	}
	// ...and a flag wins over it.
	r = mustRun(t, env("Not-A-Schema", "IDEMQ_POSTGRES_URL=postgres://u:pw@127.0.0.1:1/x"),
		"migrate", "--postgres-url", testdb.URL(), "--schema", schema)
	if !strings.Contains(r.stdout, "schema "+schema+" at version") {
		t.Fatalf("flags did not win: %s", r)
	}
	if r := idemq(t, env(schema, "IDEMQ_LOG_FORMAT=yaml"), "version"); r.code != 2 {
		t.Fatalf("malformed IDEMQ_LOG_FORMAT: %s", r)
	}
	mustRun(t, env(schema, "IDEMQ_LOG_FORMAT=yaml"), "version", "--log-format", "json")
}

func TestHelpAndVersion(t *testing.T) {
	t.Parallel()
	environ := env("idemq")
	for _, args := range [][]string{
		{"--help"}, {"migrate", "--help"}, {"topology", "apply", "--help"}, {"forward", "--help"},
		{"relay", "--help"}, {"gc", "--help"}, {"keys", "inspect", "--help"}, {"dlq", "list", "--help"},
		{"dlq", "replay", "--help"}, {"demo", "--help"}, {"bench", "--help"}, {"version", "--help"},
		{"publish", "--help"}, {"topology", "delete", "--help"},
	} {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			t.Parallel()
			r := mustRun(t, environ, args...)
			if !strings.Contains(r.stdout, "Usage:") || !strings.Contains(r.stdout, "Examples:") {
				t.Errorf("idemq %v: help without usage or examples:\n%s", args, r.stdout)
			}
		})
	}
	if r := mustRun(t, environ, "version"); !strings.HasPrefix(r.stdout, "idemq ") {
		t.Errorf("version: %s", r)
	}
}

// TestAPostgresThatRefusesFailsFast: a worker started against a database
// that does not exist, or as a role that does not exist, exits within 5 s
// with an error that names it and says what to do (not "cannot reach").
func TestAPostgresThatRefusesFailsFast(t *testing.T) {
	t.Parallel()
	schema := newSchema(t)
	for _, tc := range []struct {
		name, url, want string
	}{
		{"no database", "postgres://postgres:s3cret@127.0.0.1:5432/idemq_no_such_db?sslmode=disable", `database "idemq_no_such_db" does not exist`},
		{"no role", "postgres://idemq_no_such_role:s3cret@127.0.0.1:5432/postgres?sslmode=disable", `role "idemq_no_such_role" does not exist`},
	} {
		for _, args := range [][]string{{"forward", "--queue", "q", "--consumer", "c", "--to-exchange", "x"}, {"relay"}, {"gateway", "--listen", "127.0.0.1:0", "--consumer", "g", "--to-exchange", "x"}, {"ui", "--listen", "127.0.0.1:0"}} {
			t.Run(tc.name+"/"+args[0], func(t *testing.T) {
				t.Parallel()
				r := idemq(t, env(schema, "IDEMQ_POSTGRES_URL="+tc.url), args...)
				if r.code != 1 || r.took > 5*time.Second {
					t.Fatalf("want exit 1 within 5s: %s", r)
				}
				if !strings.Contains(r.stderr, "refuses") || !strings.Contains(r.stderr, tc.want) || !strings.Contains(r.stderr, "check the") {
					t.Errorf("want the refusal, %q and what to do: %s", tc.want, r)
				}
				if strings.Contains(r.stderr+r.stdout, "s3cret") {
					t.Errorf("password leaked: %s", r)
				}
			})
		}
	}
}

// TestABrokerThatRefusesFailsFast: a command started with a password the
// broker refuses, or a vhost it will not open, exits 1 with the refusal and
// its code (403, 530) and what to check, not "cannot reach RabbitMQ": the
// broker answered.
func TestABrokerThatRefusesFailsFast(t *testing.T) {
	t.Parallel()
	schema := newSchema(t)
	u, err := url.Parse(testamqp.URL())
	if err != nil {
		t.Fatal(err)
	}
	wrongPassword := *u
	wrongPassword.User = url.UserPassword(u.User.Username(), "s3cret-wrong")
	noVhost := *u
	noVhost.Path = "/idemq-no-such-vhost"
	for _, tc := range []struct {
		name, url, want string
	}{
		{"password", wrongPassword.String(), "refused (403)"},
		{"vhost", noVhost.String(), "refused (530)"},
	} {
		for _, args := range [][]string{{"relay"}, {"forward", "--queue", "q", "--consumer", "c", "--to-exchange", "x"}, {"dlq", "list", "--queue", "q"}, {"topology", "apply", "--queue", "q"}} {
			t.Run(tc.name+"/"+strings.Join(args[:min(2, len(args))], " "), func(t *testing.T) {
				t.Parallel()
				r := idemq(t, env(schema, "IDEMQ_AMQP_URL="+tc.url), args...)
				if r.code != 1 || r.took > 15*time.Second {
					t.Fatalf("want exit 1 within 15s: %s", r)
				}
				if !strings.Contains(r.stderr, "idemq: RabbitMQ at amqp://xxxxx@") || !strings.Contains(r.stderr, tc.want) ||
					!strings.Contains(r.stderr, "check the") || strings.Contains(r.stderr, "cannot reach") {
					t.Errorf("want the refusal, %q and what to check, not \"cannot reach\": %s", tc.want, r)
				}
				if strings.Contains(r.stderr+r.stdout, "s3cret") {
					t.Errorf("password leaked: %s", r)
				}
			})
		}
	}
}

func TestUnreachableServicesFailFastWithRedactedURL(t *testing.T) {
	t.Parallel()
	schema := newSchema(t)
	badPG := "IDEMQ_POSTGRES_URL=postgres://idemq:s3cret@127.0.0.1:1/db?sslmode=disable"
	badMQ := "IDEMQ_AMQP_URL=amqp://idemq:s3cret@127.0.0.1:1/"
	for _, tc := range []struct {
		name string
		env  string
		args []string
		want string
	}{
		{"migrate", badPG, []string{"migrate"}, "cannot reach Postgres at postgres://xxxxx@127.0.0.1:1/db"},
		{"gc", badPG, []string{"gc"}, "cannot reach Postgres at postgres://xxxxx@127.0.0.1:1/db"},
		{"keys", badPG, []string{"keys", "inspect", "--consumer", "c", "k"}, "cannot reach Postgres"},
		{"forward postgres", badPG, []string{"forward", "--queue", "q", "--consumer", "c", "--to-exchange", "x"}, "cannot reach Postgres"},
		{"relay postgres", badPG, []string{"relay"}, "cannot reach Postgres"},
		{"topology", badMQ, []string{"topology", "apply", "--queue", "q"}, "cannot reach RabbitMQ at amqp://xxxxx@127.0.0.1:1/"},
		{"dlq list", badMQ, []string{"dlq", "list", "--queue", "q"}, "cannot reach RabbitMQ"},
		{"dlq replay", badMQ, []string{"dlq", "replay", "--queue", "q"}, "cannot reach RabbitMQ"},
		{"forward rabbitmq", badMQ, []string{"forward", "--queue", "q", "--consumer", "c", "--to-exchange", "x"}, "cannot reach RabbitMQ"},
		{"relay rabbitmq", badMQ, []string{"relay"}, "cannot reach RabbitMQ"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := idemq(t, env(schema, tc.env), tc.args...)
			if r.code != 1 {
				t.Fatalf("want exit 1: %s", r)
			}
			if r.took > 15*time.Second {
				t.Errorf("took %s, want < 15s", r.took)
			}
			if !strings.Contains(r.stderr, tc.want) || !strings.Contains(r.stderr, "connection refused") {
				t.Errorf("want %q and the cause: %s", tc.want, r)
			}
			if strings.Contains(r.stderr+r.stdout, "s3cret") {
				t.Errorf("password leaked: %s", r)
			}
		})
	}
}

func TestUnmigratedSchemaIsReported(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, 2)
	schema := testdb.Schema(t, pool) // not migrated
	r := idemq(t, env(schema), "keys", "inspect", "--consumer", "c", "k")
	if r.code != 1 || !strings.Contains(r.stderr, "idemq migrate") {
		t.Fatalf("want a pointer to idemq migrate: %s", r)
	}
}

func TestMigrateRepeatedlyAndConcurrently(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, 2)
	schema := testdb.Schema(t, pool)
	first := mustRun(t, env(schema), "migrate")
	second := mustRun(t, env(schema), "migrate")
	if !strings.HasPrefix(first.stdout, "schema "+schema+" at version ") || first.stdout != second.stdout {
		t.Fatalf("want the same version twice:\n%s\n%s", first, second)
	}

	fresh := testdb.Schema(t, pool)
	var wg sync.WaitGroup
	results := make([]result, 3)
	for i := range results {
		wg.Go(func() { results[i] = idemq(t, env(fresh), "migrate") })
	}
	wg.Wait()
	for i, r := range results {
		if r.code != 0 || r.stdout != strings.Replace(first.stdout, schema, fresh, 1) {
			t.Errorf("concurrent migrate %d: %s", i, r)
		}
	}
}

func TestTopologyApply(t *testing.T) {
	t.Parallel()
	q := testamqp.Name(t, "cli-topo")
	deleteTopologyAtCleanup(t, q, []string{"500ms", "1s"}, nil, nil)
	environ := env("idemq")
	args := []string{"topology", "apply", "--queue", q, "--max-attempts", "3", "--retry-initial", "500ms", "--retry-multiplier", "2"}
	r := mustRun(t, environ, args...)
	for _, name := range []string{q, q + ".retry.500ms", q + ".retry.1s", q + ".dlx", q + ".dlq"} {
		if !strings.Contains(r.stdout, name+" ") {
			t.Errorf("output does not name %s:\n%s", name, r.stdout)
		}
	}
	conn := testamqp.Dial(t)
	for _, name := range []string{q, q + ".retry.500ms", q + ".retry.1s", q + ".dlq"} {
		queueState(t, conn, name) // fails if missing
	}
	mustRun(t, environ, args...) // idempotent
	r = idemq(t, environ, "topology", "apply", "--queue", q, "--max-attempts", "3", "--retry-initial", "500ms", "--retry-multiplier", "2", "--delivery-limit", "7")
	if r.code != 1 || !strings.Contains(r.stderr, "PRECONDITION_FAILED") {
		t.Fatalf("redeclaring with another delivery limit: want exit 1 with the broker's refusal: %s", r)
	}
}

func TestGC(t *testing.T) {
	t.Parallel()
	schema := newSchema(t)
	pool := testdb.Pool(t, 4)
	ctx := context.Background()
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"old-1", "old-2"} {
		fp, _ := dedup.BodyFingerprint([]byte(key))
		res, err := store.Reserve(ctx, dedup.Claim{Scope: dedup.Scope{Consumer: "gc", Key: key}, Fingerprint: fp})
		if err != nil {
			t.Fatal(err)
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := store.Complete(ctx, tx, res.Lease, dedup.Result{Outcome: dedup.OutcomeOK}); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := pool.Exec(ctx, "UPDATE "+schema+".keys SET completed_at = now() - interval '2 hours', created_at = now() - interval '2 hours'"); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "INSERT INTO "+schema+".outbox (exchange, routing_key, body, message_id, published_at) VALUES ('x', 'k', '', 'm1', now() - interval '2 hours'), ('x', 'k', '', 'm2', NULL)"); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "INSERT INTO "+schema+".outbox_published (id, message_id, exchange, routing_key, created_at, published_at, attempts, returns) VALUES (3, 'm3', 'x', 'k', now() - interval '3 hours', now() - interval '2 hours', 1, 0)"); err != nil {
		t.Fatal(err)
	}
	r := mustRun(t, env(schema), "gc", "--retention", "1h", "--batch", "1")
	if !strings.Contains(r.stdout, "keys: deleted 2 completed, 0 abandoned") || !strings.Contains(r.stdout, "outbox: deleted 2 published") {
		t.Fatalf("gc: %s", r)
	}
	var left int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+schema+".outbox").Scan(&left); err != nil || left != 1 {
		t.Fatalf("the pending outbox row must stay: %d, %v", left, err)
	}
}

func TestKeysInspect(t *testing.T) {
	t.Parallel()
	schema := newSchema(t)
	pool := testdb.Pool(t, 4)
	ctx := context.Background()
	for _, hashed := range []bool{false, true} {
		store, err := dedup.NewStore(pool, &dedup.Config{Schema: schema, HashKeys: hashed})
		if err != nil {
			t.Fatal(err)
		}
		key := fmt.Sprintf("order-42-%v", hashed)
		fp, _ := dedup.BodyFingerprint([]byte("body"))
		res, err := store.Reserve(ctx, dedup.Claim{Scope: dedup.Scope{Consumer: "charge", Tenant: "acme", Key: key}, Fingerprint: fp,
			TraceID: "4bf92f3577b34da6a3ce929d0e0e4736", SpanID: "00f067aa0ba902b7"})
		if err != nil {
			t.Fatal(err)
		}
		// In progress: a valid lease.
		args := []string{"keys", "inspect", "--consumer", "charge", "--tenant", "acme", key}
		if hashed {
			args = append(args, "--hashed")
		}
		r := mustRun(t, env(schema), args...)
		for _, want := range []string{"state:", "in_progress", "lease:", "valid, locked until", "key hash:", dedup.Scope{Consumer: "charge", Tenant: "acme", Key: key}.KeyHash()} {
			if !strings.Contains(r.stdout, want) {
				t.Errorf("in progress: want %q in:\n%s", want, r.stdout)
			}
		}
		if strings.Contains(r.stdout, key) {
			t.Errorf("the raw key is printed:\n%s", r.stdout)
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := store.Complete(ctx, tx, res.Lease, dedup.Result{Outcome: dedup.OutcomeRejected, Code: 402, Response: []byte("no funds")}); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		r = mustRun(t, env(schema, "IDEMQ_JAEGER_URL=http://jaeger:16686/"), append(args, "--json")...)
		var got map[string]any
		if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
			t.Fatalf("json: %v\n%s", err, r.stdout)
		}
		if got["state"] != "completed" || got["outcome"] != "rejected" || got["response_code"] != 402.0 || got["response_size"] != 8.0 ||
			got["attempts"] != 1.0 || got["completed_at"] == nil || got["trace_id"] != "4bf92f3577b34da6a3ce929d0e0e4736" ||
			got["trace_url"] != "http://jaeger:16686/trace/4bf92f3577b34da6a3ce929d0e0e4736" {
			t.Errorf("completed key: %s", r.stdout)
		}
		// The UI's trace page, from --ui-url or IDEMQ_UI_URL.
		r = mustRun(t, env(schema, "IDEMQ_UI_URL=http://127.0.0.1:8089/"), append(args, "--json")...)
		if !strings.Contains(r.stdout, `"ui_trace_url": "http://127.0.0.1:8089/trace?id=4bf92f3577b34da6a3ce929d0e0e4736"`) {
			t.Errorf("ui_trace_url from IDEMQ_UI_URL: %s", r.stdout)
		}
		r = mustRun(t, env(schema), append(args, "--ui-url", "http://ui.example:8089")...)
		if !strings.Contains(r.stdout, "ui trace:") || !strings.Contains(r.stdout, "http://ui.example:8089/trace?id=4bf92f3577b34da6a3ce929d0e0e4736") {
			t.Errorf("ui trace line: %s", r.stdout)
		}
		if r := idemq(t, env(schema), append(args, "--ui-url", "127.0.0.1:8089")...); r.code != 2 {
			t.Errorf("--ui-url without a scheme: %s", r)
		}
	}
	r := idemq(t, env(schema), "keys", "inspect", "--consumer", "charge", "absent")
	if r.code != 1 || !strings.Contains(r.stderr, "key not found") {
		t.Errorf("absent key: %s", r)
	}
	// The hashed key is not found without --hashed.
	r = idemq(t, env(schema), "keys", "inspect", "--consumer", "charge", "--tenant", "acme", "order-42-true")
	if r.code != 1 || !strings.Contains(r.stderr, "key not found") {
		t.Errorf("hashed key read raw: %s", r)
	}
}

// TestForwardDeduplicatesAcrossAKill runs three forwarders on one queue,
// kills one mid-run and restarts it, and checks that every unique key
// reaches the target exchange (exactly once for the keys forwarded before
// the kill; at least once, always with the same message_id, across it),
// that the bad messages land in the DLQ with their reasons, that the
// forwarders stop cleanly on SIGTERM, and that dlq list/replay work on what
// is left.
func TestForwardDeduplicatesAcrossAKill(t *testing.T) {
	t.Parallel()
	schema := newSchema(t)
	q := testamqp.Name(t, "cli-fwd")
	x := q + ".out"
	out := q + ".sink"
	deleteTopologyAtCleanup(t, q, []string{"200ms", "400ms"}, []string{out}, []string{x})
	environ := env(schema)
	topo := []string{"--queue", q, "--max-attempts", "3", "--retry-initial", "200ms", "--retry-multiplier", "2"}
	mustRun(t, environ, append([]string{"topology", "apply"}, topo...)...)

	conn := testamqp.Dial(t)
	ch := testamqp.Channel(t, conn)
	testamqp.Sink(t, ch, x, amqp.ExchangeFanout, out, "")

	// Traces go to an OTLP endpoint that is down: spans get real trace ids
	// (recorded with the keys) and their export fails without harm.
	environ = append(slices.Clone(environ), "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_TIMEOUT=500")
	name := "fwd-" + testdb.RandomHex(4)
	fwdArgs := append([]string{"forward", "--consumer", name, "--to-exchange", x, "--concurrency", "4",
		"--lease", "2s", "--shutdown-timeout", "10s", "--drain-timeout", "5s", "--log-level", "debug"}, topo...)
	fwd := make([]*proc, 3)
	for i := range fwd {
		args := fwdArgs
		switch i {
		case 1:
			// Groups of 100 are the default; this one lingers for groups
			// of 8, and the last commits each message alone: the same
			// guarantees.
			args = append(slices.Clone(fwdArgs), "--metrics-addr", "127.0.0.1:0", "--group-size", "8", "--group-linger", "5ms")
		case 2:
			args = append(slices.Clone(fwdArgs), "--group-size", "1")
		}
		fwd[i] = start(t, fmt.Sprintf("forwarder %d", i), environ, args...)
	}
	waitConsumers := func(n int) {
		consumertest.WaitFor(t, 30*time.Second, fmt.Sprintf("%d consumers on %s", n, q), func() bool {
			_, c := queueState(t, conn, q)
			return c == n
		})
	}
	waitConsumers(3)

	publish := func(key string, body string, headers amqp.Table) {
		testamqp.Publish(t, ch, "", q, amqp.Publishing{
			MessageId: key, Body: []byte(body), ContentType: "application/json", Headers: headers,
			DeliveryMode: amqp.Persistent,
		})
	}
	// bursts publishes 20 copies of each key from 20 goroutines at once.
	bursts := func(keys ...string) {
		var wg sync.WaitGroup
		for range 20 {
			wg.Go(func() {
				c := testamqp.Channel(t, conn)
				for _, k := range keys {
					testamqp.Publish(t, c, "", q, amqp.Publishing{MessageId: k, Body: []byte(`{"burst":"` + k + `"}`)})
				}
			})
		}
		wg.Wait()
	}
	outCount := func() int { n, _ := queueState(t, conn, out); return n }

	// Phase A, no crash: each key twice in a row, and bursts of 20 copies.
	var keysA []string
	for i := range 60 {
		k := fmt.Sprintf("a-%03d", i)
		keysA = append(keysA, k)
		body := fmt.Sprintf(`{"n":%d}`, i)
		publish(k, body, amqp.Table{"x-custom": "kept", "x-tenant-id": ""})
		publish(k, body, amqp.Table{"x-custom": "kept", "x-tenant-id": ""})
	}
	burstKeys := []string{"burst-1", "burst-2", "burst-3"}
	bursts(burstKeys...)
	keysA = append(keysA, burstKeys...)
	consumertest.WaitFor(t, 60*time.Second, "phase A forwarded", func() bool { return outCount() >= len(keysA) })
	checkMetrics(t, fwd[1])

	// Phase B: one forwarder is killed while messages flow, then restarted.
	var keysB []string
	for i := range 150 {
		k := fmt.Sprintf("b-%03d", i)
		keysB = append(keysB, k)
		publish(k, fmt.Sprintf(`{"n":%d}`, i), nil)
		if i%3 == 0 {
			publish(k, fmt.Sprintf(`{"n":%d}`, i), nil)
		}
		if i == 75 {
			fwd[0].signal(t, syscall.SIGKILL)
			if code := fwd[0].wait(t, 10*time.Second); code != -int(syscall.SIGKILL) {
				t.Fatalf("killed forwarder exit: %d", code)
			}
			fwd[0] = start(t, "forwarder 0 (restarted)", environ, fwdArgs...)
		}
	}
	bursts("burst-b")
	keysB = append(keysB, "burst-b")
	waitConsumers(3)
	// Done when every key is completed and its outbox row published: copies
	// of the killed forwarder's keys wait in a retry tier for its lease, and
	// the output's duplicates make a count of its messages no proof.
	pool := testdb.Pool(t, 2)
	consumertest.WaitFor(t, 90*time.Second, "phase B forwarded", func() bool {
		var completed, pending int
		err := pool.QueryRow(context.Background(), "SELECT (SELECT count(*) FROM "+schema+".keys WHERE state = 'completed'), (SELECT count(*) FROM "+schema+".outbox WHERE published_at IS NULL)").Scan(&completed, &pending)
		return err == nil && completed == len(keysA)+len(keysB) && pending == 0 && outCount() >= len(keysA)+len(keysB)
	})

	// Bad messages, published once the keys they reuse are completed.
	publish("a-000", `{"n":"changed"}`, nil) // same key, another body
	publish("b-001", `{"n":"changed"}`, nil)
	publish("", `{"no":"key"}`, nil)
	testamqp.Publish(t, ch, "", q, amqp.Publishing{Body: []byte(`{"no":"key either"}`)})
	publish("bad\x01key", `{}`, nil)
	publish("", `{}`, amqp.Table{"Idempotency-Key": strings.Repeat("k", 300)}) // too long
	wantDLQ := map[string]int{"idempotency_key_reuse": 2, "idempotency_key_required": 2, "idempotency_key_invalid": 2}
	consumertest.WaitFor(t, 30*time.Second, "6 dead letters", func() bool { n, _ := queueState(t, conn, q+".dlq"); return n == 6 })

	// SIGTERM: every forwarder drains and exits 0 within its bounds.
	for _, p := range fwd {
		p.signal(t, syscall.SIGTERM)
	}
	for _, p := range fwd {
		if code := p.wait(t, 30*time.Second); code != 0 {
			t.Fatalf("%s exited %d after SIGTERM:\n%s", p.name, code, p.stderr.String())
		}
	}
	var pending int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM "+schema+".outbox WHERE published_at IS NULL").Scan(&pending); err != nil || pending != 0 {
		t.Fatalf("outbox rows left unpublished: %d, %v", pending, err)
	}

	// What reached X: the set of message_ids is exactly the unique keys;
	// phase A's keys exactly once.
	seen := map[string]int{}
	for _, d := range drain(t, conn, out) {
		seen[d.MessageId]++
		if d.MessageId == "a-001" {
			if d.Headers["x-custom"] != "kept" || d.ContentType != "application/json" || string(d.Body) != `{"n":1}` {
				t.Errorf("forwarded message lost its content: %+v", d)
			}
			for k := range d.Headers {
				if strings.HasPrefix(k, "x-idemq-") {
					t.Errorf("forwarded message carries %s", k)
				}
			}
		}
	}
	for _, k := range keysA {
		if seen[k] != 1 {
			t.Errorf("key %s forwarded %d times before the kill, want exactly 1", k, seen[k])
		}
	}
	for _, k := range keysB {
		if seen[k] < 1 {
			t.Errorf("key %s never forwarded", k)
		}
	}
	if len(seen) != len(keysA)+len(keysB) {
		t.Errorf("forwarded %d distinct message ids, want %d", len(seen), len(keysA)+len(keysB))
	}

	// keys inspect of a processed key.
	r := mustRun(t, environ, "keys", "inspect", "--consumer", name, "--json", "a-001")
	var rec map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &rec); err != nil || rec["state"] != "completed" || rec["outcome"] != "ok" {
		t.Errorf("keys inspect: %v: %s", err, r)
	}
	if id, _ := rec["trace_id"].(string); len(id) != 32 || strings.Trim(id, "0") == "" {
		t.Errorf("keys inspect: no trace id of the first processing: %s", r.stdout)
	}

	// dlq list shows the reasons and takes nothing away.
	r = mustRun(t, environ, "dlq", "list", "--queue", q, "--json")
	var list struct {
		InQueue  int            `json:"in_queue"`
		ByReason map[string]int `json:"by_reason"`
		Letters  []struct {
			MessageID string `json:"message_id"`
			Reason    string `json:"reason"`
			Attempts  int    `json:"attempts"`
			FirstSeen string `json:"first_seen"`
			Exchange  string `json:"original_exchange"`
			Routing   string `json:"original_routing_key"`
			Error     string `json:"error"`
		} `json:"letters"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &list); err != nil {
		t.Fatalf("dlq list json: %v\n%s", err, r.stdout)
	}
	if list.InQueue != 6 || len(list.Letters) != 6 || fmt.Sprint(list.ByReason) != fmt.Sprint(wantDLQ) {
		t.Fatalf("dlq list: %s", r.stdout)
	}
	for _, l := range list.Letters {
		if l.FirstSeen == "" || l.Routing != q || l.Error == "" || l.Attempts != 1 {
			t.Errorf("dead letter without its metadata: %+v", l)
		}
	}
	r = mustRun(t, environ, "dlq", "list", "--queue", q)
	if !strings.Contains(r.stdout, "idempotency_key_reuse: 2") || !strings.Contains(r.stdout, ": 6 dead letters") {
		t.Errorf("dlq list text: %s", r.stdout)
	}
	// The messages read go back when the command's channel closes (a
	// quorum queue applies the return shortly after).
	consumertest.WaitFor(t, 10*time.Second, "the listed dead letters back in the DLQ", func() bool {
		n, _ := queueState(t, conn, q+".dlq")
		return n == 6
	})

	// A reused key's letters come straight back: replaying them is refused
	// unless asked for explicitly, and then dlq replay --reason moves
	// exactly the reused keys back to Q. Copies still in the retry tiers
	// (busy duplicates) may reach Q too: keep only what is not a duplicate
	// of a forwarded key.
	if r := idemq(t, environ, "dlq", "replay", "--queue", q, "--reason", "idempotency_key_reuse"); r.code != 2 ||
		!strings.Contains(r.stderr, "cannot succeed unchanged") || !strings.Contains(r.stderr, "--allow-doomed") || r.stdout != "" {
		t.Fatalf("dlq replay of reused keys without --allow-doomed: %s", r)
	}
	r = mustRun(t, environ, "dlq", "replay", "--queue", q, "--reason", "idempotency_key_reuse", "--allow-doomed")
	if strings.TrimSpace(r.stdout) != "replayed 2, skipped 4" {
		t.Fatalf("dlq replay: %s", r)
	}
	consumertest.WaitFor(t, 10*time.Second, "the 4 skipped dead letters back in the DLQ", func() bool {
		n, _ := queueState(t, conn, q+".dlq")
		return n == 4
	})
	replayed := map[string]amqp.Delivery{}
	for _, d := range drain(t, conn, q) {
		if strings.Contains(string(d.Body), "changed") {
			replayed[d.MessageId] = d
		}
	}
	if len(replayed) != 2 || replayed["a-000"].MessageId == "" || replayed["b-001"].MessageId == "" {
		t.Fatalf("replayed messages in %s: %v", q, replayed)
	}
	for id, d := range replayed {
		if d.Headers["x-idemq-attempt"] != int32(1) || d.Headers["x-idemq-reason"] != nil || d.Headers["x-idemq-first-seen"] == nil {
			t.Errorf("replayed %s headers: %v", id, d.Headers)
		}
	}
	r = mustRun(t, environ, "dlq", "list", "--queue", q, "--json")
	var after struct {
		ByReason map[string]int `json:"by_reason"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &after); err != nil || fmt.Sprint(after.ByReason) != "map[idempotency_key_invalid:2 idempotency_key_required:2]" {
		t.Errorf("dlq after replay: %v %s", err, r.stdout)
	}
}

func TestDemo(t *testing.T) {
	t.Parallel()
	suffix := testdb.RandomHex(4)
	schema, queue := "idemq_demo_cli_"+suffix, "idemq.demo.cli."+suffix
	pool := testdb.Pool(t, 2)
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+schema+" CASCADE")
	})
	deleteTopologyAtCleanup(t, queue, []string{"200ms", "400ms", "800ms"}, nil, nil)
	r := mustRun(t, env("idemq"), "demo", "--payments", "60", "--http-payments", "30", "--workers", "2", "--concurrency", "4",
		"--demo-schema", schema, "--queue", queue, "--log-dir", t.TempDir())
	for _, want := range []string{"Report", "effects applied", "killed with SIGKILL", "HTTP front door", "409 in progress", "HTTP: charges == unique operations (30)", "OK: "} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("demo output lacks %q:\n%s", want, r.stdout)
		}
	}
}

var metricsAddrLog = regexp.MustCompile(`msg="serving metrics" addr=(\S+)`)

// checkMetrics reads the Prometheus endpoint of a forwarder started with
// --metrics-addr 127.0.0.1:0 (its address is in its log).
func checkMetrics(t *testing.T, p *proc) {
	t.Helper()
	var addr string
	consumertest.WaitFor(t, 10*time.Second, "the metrics address in the log", func() bool {
		m := metricsAddrLog.FindStringSubmatch(p.stderr.String())
		if m != nil {
			addr = m[1]
		}
		return m != nil
	})
	get := func(path string) string {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s: %d %v", path, resp.StatusCode, err)
		}
		return string(b)
	}
	if body := get("/healthz"); strings.TrimSpace(body) != "ok" {
		t.Errorf("/healthz: %q", body)
	}
	if body := get("/metrics"); !strings.Contains(body, "idemq_consumer_deliveries") {
		t.Errorf("/metrics has no consumer deliveries:\n%s", body)
	}
}

// idemq bench runs every default row in one run and prints the tables, with
// each row's ratio to its bare row, and writes the plot. The peers that
// need modules of their own from the network (Watermill, River) are left
// out here (--watermill-dir "" --river-dir ""); the reference consumers of
// ../shared/benchref run when that module is there, else their rows must
// say why they did not.
func TestBench(t *testing.T) {
	plot := filepath.Join(t.TempDir(), "bench.svg")
	// About thirty rows, each a worker process or two: minutes on a loaded machine.
	r := idemqWithin(t, 8*time.Minute, env("idemq"), "bench", "--messages", "400", "--paced", "20", "--paced-rate", "100",
		"--max-duration", "10s", "--http-duration", "1s", "--watermill-dir", "", "--river-dir", "", "--plot", plot)
	if r.code != 0 {
		t.Fatalf("idemq bench: %s", r)
	}
	consume := []string{
		"bare amqp091-go consume+ack", "idemq per-message (1 tx/msg)", "idemq per-message, group commit 32",
		"idemq per-message, optimistic group 32", "idemq optimistic 32, separate reservations", "idemq batch handler 100", "idemq batch 100, separate reservations", "idemq batch 100, 2 in flight, linger 5ms", "idemq optimistic group 32, 20% dup",
		"idemq batch 100, 20% dup", "bare amqp091-go, again",
	}
	reference := []string{
		"benchref floor: ledger rows, 1 tx, no dedup", "benchref tx1: keys+ledger, 1 tx",
		"benchref tx2: claim+ledger+complete, 1 tx", "benchref dedup: claim, complete, no effect",
		"benchref tx2, again",
	}
	publish := []string{
		"bare publish+confirms (window 1000), quorum", "idemq relay batch 100, quorum", "idemq relay batch 500, quorum",
		"bare publish+confirms, quorum, again",
		"bare publish+confirms (window 1000), classic", "idemq relay batch 100, classic", "idemq relay batch 500, classic",
		"bare publish+confirms, classic, again",
		"bare pipe: consume, publish+confirm, ack", "idemq forward: claim, outbox, relay", "bare pipe, again",
	}
	http := []string{
		"http bare: POST, one INSERT in one tx", "http idemhttp: the same handler, guarded", "http idemhttp: the same handler, guarded, 20% dup",
		"http bare publish: POST → publish with confirms", "idemq gateway", "idemq gateway, 20% dup",
	}
	i, j, k := strings.Index(r.stdout, "scenario  msg/s"), strings.Index(r.stdout, "publishing side  msg/s"), strings.Index(r.stdout, "HTTP front door  req/s")
	if i < 0 || j < i || k < j {
		t.Fatalf("no consumer table followed by a publishing table and the HTTP front door's:\n%s", r.stdout)
	}
	consumeTable, publishTable, httpTable := r.stdout[i:j], r.stdout[j:k], r.stdout[k:]
	// A row that ran: throughput, a ratio, and CPU per message for the
	// worker and for all three processes together.
	ran := func(table, row string) {
		t.Helper()
		fields := regexp.MustCompile(`(?m)^\s*` + regexp.QuoteMeta(row) + `\s+(\d+)\s+(\d+)%.*\s(\S+)\s*$`).FindStringSubmatch(table)
		if fields == nil {
			t.Errorf("no table row for %q:\n%s", row, r.stdout)
			return
		}
		if fields[1] == "0" || fields[2] == "0" || fields[3] == "n/a" {
			t.Errorf("row %q has no throughput, ratio or CPU: %s", row, fields[0])
		}
	}
	for _, row := range consume {
		ran(consumeTable, row)
	}
	for _, row := range publish {
		ran(publishTable, row)
	}
	for _, row := range http {
		ran(httpTable, row)
	}
	if _, err := os.Stat(filepath.Join("..", "..", "..", "shared", "benchref", "go.mod")); err == nil {
		for _, row := range reference {
			ran(consumeTable, row)
		}
		// The targets are printed against the reference's two runs.
		for _, want := range []string{`batch handler ≥ 100% of tx2: \d+%, (met|missed)`, `default mode ≥ 50% of tx2 \(#32\): \d+%, (met|missed)`} {
			if !regexp.MustCompile(`(?m)^targets: .*` + want).MatchString(consumeTable) {
				t.Errorf("the consumer table's targets do not match %q:\n%s", want, consumeTable)
			}
		}
	} else {
		t.Logf("no ../shared/benchref beside the repository: its rows must say so")
		for _, row := range reference {
			if !regexp.MustCompile(`note: ` + regexp.QuoteMeta(row) + `: not run: no benchref module`).MatchString(consumeTable) {
				t.Errorf("row %q does not say why it did not run:\n%s", row, r.stdout)
			}
		}
	}
	for _, want := range []string{`relay batch 500 into a quorum queue ≥ 80% of bare: \d+%, (met|missed)`, `forward ≥ 60% of the bare pipe: \d+%, (met|missed)`} {
		if !regexp.MustCompile(`(?m)^targets: .*` + want).MatchString(publishTable) {
			t.Errorf("the publishing table's targets do not match %q:\n%s", want, publishTable)
		}
	}
	if strings.Contains(r.stdout, "watermill +") || strings.Contains(r.stdout, "river JobCompleteTx") {
		t.Errorf("peer rows ran although --watermill-dir and --river-dir are empty:\n%s", r.stdout)
	}
	svg, err := os.ReadFile(plot)
	if err != nil || !strings.HasPrefix(string(svg), "<svg") {
		t.Fatalf("plot %s: %v %.40q", plot, err, svg)
	}
}
