package consumer_test

import (
	"context"
	"errors"
	"log/slog"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

// logRecords collects a consumer's log records.
type logRecords struct {
	mu   sync.Mutex
	recs []logRecord
}

type logRecord struct {
	level slog.Level
	msg   string
	attrs map[string]string
}

func (l *logRecords) logger() *slog.Logger { return slog.New(&recordHandler{l: l}) }

// find returns the records with message msg.
func (l *logRecords) find(msg string) []logRecord {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []logRecord
	for _, r := range l.recs {
		if r.msg == msg {
			out = append(out, r)
		}
	}
	return out
}

// withAttr returns the records whose attribute key is value.
func (l *logRecords) withAttr(key, value string) []logRecord {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []logRecord
	for _, r := range l.recs {
		if r.attrs[key] == value {
			out = append(out, r)
		}
	}
	return out
}

// all returns every record, one line each, for failure messages.
func (l *logRecords) all() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var b strings.Builder
	for _, r := range l.recs {
		b.WriteString("\n  " + r.level.String() + " " + r.msg)
		for k, v := range r.attrs {
			b.WriteString(" " + k + "=" + v)
		}
	}
	return b.String()
}

type recordHandler struct {
	l     *logRecords
	attrs []slog.Attr
}

func (h *recordHandler) Enabled(context.Context, slog.Level) bool { return true }

func (h *recordHandler) Handle(_ context.Context, r slog.Record) error {
	rec := logRecord{level: r.Level, msg: r.Message, attrs: map[string]string{}}
	for _, a := range h.attrs {
		rec.attrs[a.Key] = a.Value.String()
	}
	r.Attrs(func(a slog.Attr) bool {
		rec.attrs[a.Key] = a.Value.String()
		return true
	})
	h.l.mu.Lock()
	h.l.recs = append(h.l.recs, rec)
	h.l.mu.Unlock()
	return nil
}

func (h *recordHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &recordHandler{l: h.l, attrs: append(h.attrs[:len(h.attrs):len(h.attrs)], as...)}
}

func (h *recordHandler) WithGroup(string) slog.Handler { return h }

func okHandler(context.Context, pgx.Tx, *consumer.Delivery) (consumer.Response, error) {
	return consumer.Response{Code: 200}, nil
}

// runReturns runs c until it returns, and fails the test if it has not
// within timeout.
func runReturns(t *testing.T, c *consumer.Consumer, timeout time.Duration) error {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	select {
	case err := <-done:
		cancel()
		return err
	case <-time.After(timeout):
		cancel()
		<-done
		t.Fatalf("Run did not return within %s", timeout)
		return nil
	}
}

// waitReady polls c.Ready until cond holds of its error.
func waitReady(t *testing.T, c *consumer.Consumer, timeout time.Duration, what string, cond func(error) bool) error {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := c.Ready()
		if cond(err) {
			return err
		}
		if time.Now().After(deadline) {
			t.Fatalf("Ready after %s: %v; want %s", timeout, err, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestRunRefusesAnUnmigratedSchema: Run over a schema never migrated, or one
// migration behind, returns at once an error that says to run idemq
// migrate, and leaves the queue's message alone instead of cycling it
// through the tiers. HeaderKeys are configured, so that the stored keys'
// table is not what gives the schema away.
func TestRunRefusesAnUnmigratedSchema(t *testing.T) {
	t.Parallel()
	h := newHarness(t, modeGroup, func(c *consumer.Config) {
		c.HeaderKeys = [][]byte{[]byte("0123456789abcdef0123456789abcdef")}
	})
	h.publish("k-1", `{"amount":1}`, nil)
	ctx := context.Background()
	_, known, err := schema.Version(ctx, h.pool, h.schema)
	if err != nil {
		t.Fatal(err)
	}
	empty := testdb.Schema(t, h.pool)
	behind := testdb.Schema(t, h.pool)
	if err := schema.MigrateTo(ctx, h.pool, behind, known-1); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{empty, behind} {
		store, err := dedup.NewStore(h.pool, &dedup.Config{Schema: name})
		if err != nil {
			t.Fatal(err)
		}
		c, err := consumer.New(store, okHandler, &h.cfg)
		if err != nil {
			t.Fatal(err)
		}
		err = runReturns(t, c, 10*time.Second)
		if !errors.Is(err, dedup.ErrNotMigrated) || !strings.Contains(err.Error(), "idemq migrate") {
			t.Fatalf("Run over schema %s: %v; want ErrNotMigrated saying to run idemq migrate", name, err)
		}
		if r := c.Ready(); !errors.Is(r, consumer.ErrNotReady) || !errors.Is(r, dedup.ErrNotMigrated) {
			t.Fatalf("Ready after Run refused the schema: %v; want ErrNotReady and ErrNotMigrated", r)
		}
	}
	h.waitQueue(h.cfg.Queue, 5*time.Second, "the message left alone", func(q amqp.Queue) bool { return q.Messages == 1 })
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.events) != 0 {
		t.Fatalf("outcomes %v; want none", countOutcomes(h.events))
	}
}

// TestRunRefusesWhatRetryingCannotFix: on the first connect, a wrong
// password and a vhost that does not exist end Run at once with an error
// (that does not carry the password); a malformed URL is refused by New; a
// broker out of reach is retried, with a log line saying it never connected
// yet.
func TestRunRefusesWhatRetryingCannotFix(t *testing.T) {
	t.Parallel()
	h := newHarness(t, modeGroup, nil)
	_, userURL := testamqp.AddUser(t, "speak")
	wrong, err := url.Parse(userURL)
	if err != nil {
		t.Fatal(err)
	}
	user := wrong.User.Username()
	wrong.User = url.UserPassword(user, "not-the-password")
	vhost, err := url.Parse(testamqp.URL())
	if err != nil {
		t.Fatal(err)
	}
	vhost.Path = "/no-such-vhost-" + testdb.RandomHex(4)

	for _, tc := range []struct {
		name, url string
		code      int // of the broker's refusal; 0: not the broker's
	}{
		{"wrong password", wrong.String(), amqp.AccessRefused},
		{"unknown vhost", vhost.String(), amqp.NotAllowed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := h.cfg
			cfg.URL = tc.url
			c, err := consumer.New(h.store, okHandler, &cfg)
			if err != nil {
				t.Fatal(err)
			}
			err = runReturns(t, c, 20*time.Second)
			if err == nil {
				t.Fatal("Run returned nil; want the refusal")
			}
			if strings.Contains(err.Error(), "not-the-password") || strings.Contains(err.Error(), "secret-pw") {
				t.Errorf("the error carries the password: %v", err)
			}
			var ae *amqp.Error
			if tc.code != 0 && (!errors.As(err, &ae) || ae.Code != tc.code) {
				t.Errorf("Run: %v; want the broker's %d", err, tc.code)
			}
			if r := c.Ready(); !errors.Is(r, consumer.ErrNotReady) {
				t.Errorf("Ready after the refusal: %v; want ErrNotReady", r)
			}
		})
	}

	// A malformed URL, alone or anywhere in a list, is refused by New.
	for _, bad := range []string{
		"http://guest:secret-pw@127.0.0.1:5672/",
		testamqp.URL() + ",http://guest:secret-pw@127.0.0.1:5672/",
		"amqp://guest:secret-pw@127.0.0.1:1/,,",
	} {
		cfg := h.cfg
		cfg.URL = bad
		_, err := consumer.New(h.store, okHandler, &cfg)
		if err == nil {
			t.Fatalf("New with URL %s: nil error", redact.URL(bad))
		}
		if strings.Contains(err.Error(), "secret-pw") {
			t.Errorf("the error carries the password: %v", err)
		}
	}

	t.Run("broker out of reach", func(t *testing.T) {
		logs := &logRecords{}
		cfg := h.cfg
		cfg.URL = "amqp://guest:guest@127.0.0.1:1/"
		cfg.Logger = logs.logger()
		c, err := consumer.New(h.store, okHandler, &cfg)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- c.Run(ctx) }()
		// The outage is logged once when it starts (internal/outage), not
		// at every retry.
		deadline := time.Now().Add(20 * time.Second)
		for len(logs.find("cannot start consuming (never connected yet); retrying")) < 1 {
			select {
			case err := <-done:
				cancel()
				t.Fatalf("Run returned %v while the broker was out of reach; want retries", err)
			case <-time.After(10 * time.Millisecond):
			}
			if time.Now().After(deadline) {
				cancel()
				<-done
				t.Fatalf("the outage not logged within 20s:%s", logs.all())
			}
		}
		if r := c.Ready(); !errors.Is(r, consumer.ErrNotReady) || !strings.Contains(r.Error(), "not yet connected") {
			t.Errorf("Ready while never connected: %v; want not yet connected", r)
		}
		if n := len(logs.find("broker connection lost; reconnecting")); n != 0 {
			t.Errorf("%d lines say the connection was lost; it never was made", n)
		}
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("Run after cancel: %v", err)
		}
	})
}

// TestReady: Ready is an error before Run, nil once the consumer consumes,
// an error saying it reconnects while the broker refuses it after its
// connection was closed (a refusal once connected is retried, not
// returned), nil again once it consumes again, and an error after Run.
func TestReady(t *testing.T) {
	t.Parallel()
	user, userURL := testamqp.AddUser(t, "ready")
	h := newHarness(t, modeGroup, func(c *consumer.Config) { c.URL = userURL })
	c, err := consumer.New(h.store, okHandler, &h.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Ready(); !errors.Is(err, consumer.ErrNotReady) {
		t.Fatalf("Ready before Run: %v; want ErrNotReady", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() {
		cancel()
		<-done
	}()
	waitReady(t, c, 30*time.Second, "nil (consuming)", func(err error) bool { return err == nil })

	testamqp.SetPermissions(t, user, false)
	if n := testamqp.CloseConnections(t, h.cfg.ConnectionName); n == 0 {
		t.Fatal("no connection of the consumer to close")
	}
	waitReady(t, c, 30*time.Second, "reconnecting", func(err error) bool {
		return errors.Is(err, consumer.ErrNotReady) && strings.Contains(err.Error(), "reconnecting")
	})
	select {
	case err := <-done:
		t.Fatalf("Run returned %v after a refusal once connected; want it to keep reconnecting", err)
	default:
	}
	testamqp.SetPermissions(t, user, true)
	waitReady(t, c, 60*time.Second, "nil (consuming again)", func(err error) bool { return err == nil })

	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	done <- nil // for the deferred wait
	if err := c.Ready(); !errors.Is(err, consumer.ErrNotReady) {
		t.Fatalf("Ready after Run: %v; want ErrNotReady", err)
	}
}

// TestRunRefusesAPostgresThatRefuses: a database that does not exist and a
// role that does not exist end Run within 5 s with an error that names
// them and says what to do, instead of WARN lines for ever; a Postgres out
// of reach is still retried (TestRunRefusesWhatRetryingCannotFix's broker
// counterpart).
func TestRunRefusesAPostgresThatRefuses(t *testing.T) {
	t.Parallel()
	h := newHarness(t, modeGroup, func(c *consumer.Config) {
		c.HeaderKeys = [][]byte{[]byte("0123456789abcdef0123456789abcdef")}
	})
	u, err := url.Parse(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	noDB, noRole := *u, *u
	noDB.Path = "/idemq_no_such_db"
	noRole.User = url.User("idemq_no_such_role")
	for _, c := range []struct {
		url, want string
	}{
		{noDB.String(), `database "idemq_no_such_db" does not exist`},
		{noRole.String(), `role "idemq_no_such_role" does not exist`},
	} {
		if testdb.Pooled() && strings.Contains(c.want, "role") {
			c.want = "no such user" // PgBouncer's own words, which name no role
		}
		pool, err := pgxpool.New(context.Background(), c.url)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		store, err := dedup.NewStore(pool, &dedup.Config{Schema: h.schema})
		if err != nil {
			t.Fatal(err)
		}
		cons, err := consumer.New(store, okHandler, &h.cfg)
		if err != nil {
			t.Fatal(err)
		}
		err = runReturns(t, cons, 5*time.Second)
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "Postgres refuses") || !strings.Contains(err.Error(), "check the") {
			t.Fatalf("Run against %s: %v; want an error naming %q and what to do", redact.DSN(c.url), err, c.want)
		}
	}
}
