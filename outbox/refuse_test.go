package outbox_test

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/claim"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
)

// TestRelayRefusesWhatRetryingCannotFix: a wrong password and a vhost that
// does not exist end Run at once with the broker's refusal; a broker out of
// reach at start is retried.
func TestRelayRefusesWhatRetryingCannotFix(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	_, userURL := testamqp.AddUser(t, "relay")
	wrong, err := url.Parse(userURL)
	if err != nil {
		t.Fatal(err)
	}
	wrong.User = url.UserPassword(wrong.User.Username(), "not-the-password")
	vhost, err := url.Parse(testamqp.URL())
	if err != nil {
		t.Fatal(err)
	}
	vhost.Path = "/no-such-vhost-" + testdb.RandomHex(4)

	for _, tc := range []struct {
		name, url string
		code      int
	}{
		{"wrong password", wrong.String(), amqp.AccessRefused},
		{"unknown vhost", vhost.String(), amqp.NotAllowed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := outbox.NewRelay(e.ob, tc.url, e.relayConfig(t))
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			err = r.Run(ctx)
			if ctx.Err() != nil {
				t.Fatalf("Run kept retrying for 20s (%v); want the refusal at once", err)
			}
			var ae *amqp.Error
			if !errors.As(err, &ae) || ae.Code != tc.code {
				t.Fatalf("Run: %v; want the broker's %d", err, tc.code)
			}
		})
	}

	t.Run("broker out of reach", func(t *testing.T) {
		cfg := e.relayConfig(t)
		cfg.ReconnectInitial, cfg.ReconnectMax = 10*time.Millisecond, 50*time.Millisecond
		r, err := outbox.NewRelay(e.ob, "amqp://guest:guest@127.0.0.1:1/", cfg)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- r.Run(ctx) }()
		waitFor(t, 20*time.Second, "two reconnects", func() bool {
			st, err := r.Stats(context.Background())
			select {
			case err := <-done:
				t.Fatalf("Run returned %v while the broker was out of reach; want retries", err)
			default:
			}
			return err == nil && st.Reconnects >= 2
		})
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("Run after cancel: %v", err)
		}
	})
}

// TestRelayRetriesARefusalOnceConnected: once the relay has published, a
// broker that refuses its user is retried until it takes it back.
func TestRelayRetriesARefusalOnceConnected(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	user, userURL := testamqp.AddUser(t, "relay")
	cfg := e.relayConfig(t)
	r, err := outbox.NewRelay(e.ob, userURL, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	enqueue := func(key string) {
		t.Helper()
		c := dedup.Scope{Consumer: "writer", Key: key}
		tx, err := e.pool.Begin(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(context.Background()) }()
		if err := e.ob.Enqueue(claim.With(context.Background(), c), tx, outbox.Message{Exchange: e.exchange, RoutingKey: boundKey, Body: []byte(key)}); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	published := func(n int64) func() bool {
		return func() bool {
			st, err := r.Stats(context.Background())
			return err == nil && st.Published >= n
		}
	}
	enqueue("before")
	waitFor(t, 30*time.Second, "the first row published", published(1))

	testamqp.SetPermissions(t, user, false)
	before, err := r.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if n := testamqp.CloseConnections(t, cfg.ConnectionName); n == 0 {
		t.Fatal("no relay connection to close")
	}
	waitFor(t, 30*time.Second, "a refused reconnect", func() bool {
		st, err := r.Stats(context.Background())
		return err == nil && st.Reconnects >= before.Reconnects+2
	})
	select {
	case err := <-done:
		t.Fatalf("Run returned %v after a refusal once connected; want it to keep reconnecting", err)
	default:
	}
	testamqp.SetPermissions(t, user, true)
	enqueue("after")
	waitFor(t, 60*time.Second, "the second row published", published(2))
}

// TestRelayRefusesAnUnmigratedSchema: Run over a schema never migrated
// returns at once an error saying to run idemq migrate, instead of retrying
// its batches forever.
func TestRelayRefusesAnUnmigratedSchema(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, 2)
	ob, err := outbox.New(pool, &outbox.Config{Schema: testdb.Schema(t, pool)})
	if err != nil {
		t.Fatal(err)
	}
	r, err := outbox.NewRelay(ob, testamqp.URL(), &outbox.RelayConfig{ConnectionName: testamqp.Name(t, "idemq-test-relay")})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	err = r.Run(ctx)
	if ctx.Err() != nil || !errors.Is(err, schema.ErrNotMigrated) || !strings.Contains(err.Error(), "idemq migrate") {
		t.Fatalf("Run over an empty schema: %v; want ErrNotMigrated saying to run idemq migrate, at once", err)
	}
}

// TestRelayRefusesAPostgresThatRefuses: a database that does not exist ends
// Run within 5 s with an error naming it and saying what to do.
func TestRelayRefusesAPostgresThatRefuses(t *testing.T) {
	t.Parallel()
	u, err := url.Parse(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/idemq_no_such_db"
	pool, err := pgxpool.New(context.Background(), u.String())
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	ob, err := outbox.New(pool, &outbox.Config{Schema: "idemq"})
	if err != nil {
		t.Fatal(err)
	}
	r, err := outbox.NewRelay(ob, testamqp.URL(), &outbox.RelayConfig{ConnectionName: testamqp.Name(t, "idemq-test-relay")})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err = r.Run(ctx)
	if ctx.Err() != nil || err == nil || !strings.Contains(err.Error(), `database "idemq_no_such_db" does not exist`) || !strings.Contains(err.Error(), "check the database name") {
		t.Fatalf("Run against a database that does not exist: %v; want an error naming it and what to do, within 5 s", err)
	}
}
