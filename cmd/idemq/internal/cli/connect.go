package cli

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/amqpdial"
	"github.com/idemq/idemq/internal/pgfatal"
	"github.com/idemq/idemq/internal/redact"
)

// openPostgres opens a pool of at most maxConns connections and checks that
// Postgres answers within the connect timeout. Its error is one line that
// names the (redacted) URL and the cause.
func (a *app) openPostgres(ctx context.Context, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := a.postgresConfig()
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.ConnectTimeout = a.connectTimeout
	cfg.MaxConns = max(maxConns, 1)
	cfg.MinConns = 0
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("cannot reach Postgres at %s: %s", redact.DSN(a.postgresURL), cause(err, a.connectTimeout))
	}
	pctx, cancel := context.WithTimeout(ctx, 2*a.connectTimeout)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if pgfatal.Refused(err) {
			var refused *pgfatal.Error
			errors.As(pgfatal.Explain(err), &refused)
			return nil, fmt.Errorf("Postgres at %s refuses: %s; %s", redact.DSN(a.postgresURL), cause(err, a.connectTimeout), refused.Advice)
		}
		return nil, fmt.Errorf("cannot reach Postgres at %s: %s", redact.DSN(a.postgresURL), cause(err, a.connectTimeout))
	}
	return pool, nil
}

// postgresConfig parses --postgres-url. A URL that does not parse is bad
// usage (exit 2), reported without its credentials.
func (a *app) postgresConfig() (*pgxpool.Config, error) {
	if scheme, _, ok := strings.Cut(a.postgresURL, "://"); ok && scheme != "postgres" && scheme != "postgresql" {
		return nil, usagef("--postgres-url %s: want a postgres:// or postgresql:// URL, or key=value settings", redact.DSN(a.postgresURL))
	}
	cfg, err := pgxpool.ParseConfig(a.postgresURL)
	if err != nil {
		// pgx quotes the string with its password masked; redact the rest.
		return nil, usagef("--postgres-url: %s", redact.Error(err))
	}
	return cfg, nil
}

// directConfig parses --postgres-direct-url: nil when it is not given, the
// pool's own config then serving what needs a session (LISTEN, VACUUM).
func (a *app) directConfig() (*pgx.ConnConfig, error) {
	if a.postgresDirectURL == "" {
		return nil, nil
	}
	cfg, err := pgx.ParseConfig(a.postgresDirectURL)
	if err != nil {
		return nil, usagef("--postgres-direct-url: %s", redact.Error(err))
	}
	return cfg, nil
}

// amqpAddrs parses --amqp-url: one AMQP URL or several (the flag repeated,
// or separated by commas). A URL that does not parse is bad usage (exit 2),
// reported without its credentials.
func (a *app) amqpAddrs() (amqpdial.Addrs, error) {
	addrs, err := amqpdial.Parse(a.amqpURL)
	if err != nil {
		return amqpdial.Addrs{}, usagef("--amqp-url: %w", err)
	}
	return addrs, nil
}

// checkAMQPURL checks --amqp-url (see amqpAddrs).
func (a *app) checkAMQPURL() error {
	_, err := a.amqpAddrs()
	return err
}

// checkURLs parses both connection URLs, for the commands that use both
// (forward, relay, demo, bench), before they connect to either.
func (a *app) checkURLs() error {
	if _, err := a.postgresConfig(); err != nil {
		return err
	}
	if _, err := a.directConfig(); err != nil {
		return err
	}
	return a.checkAMQPURL()
}

// requireSchema fails with a pointer to `idemq migrate` when the schema's
// tables do not exist yet.
func (a *app) requireSchema(ctx context.Context, pool *pgxpool.Pool) error {
	applied, known, err := schema.Version(ctx, pool, a.schema)
	switch {
	case err != nil:
		return fmt.Errorf("read schema version of %s: %s", a.schema, cause(err, a.connectTimeout))
	case applied == 0:
		return fmt.Errorf("schema %s is not migrated: run `idemq migrate --schema %s` first", a.schema, a.schema)
	case applied < known:
		return fmt.Errorf("schema %s is at version %d, this idemq needs %d: run `idemq migrate --schema %s` first", a.schema, applied, known, a.schema)
	}
	return nil
}

// dialAMQP opens a broker connection named name to the first address of
// --amqp-url that answers within --connect-timeout, tried in random order.
// Its error is one line that names each (redacted) URL tried and the cause.
func (a *app) dialAMQP(name string) (*amqp.Connection, error) {
	addrs, err := a.amqpAddrs()
	if err != nil {
		return nil, err
	}
	d := amqpdial.Dialer{Addrs: addrs, Name: name, Timeout: a.connectTimeout}
	conn, err := d.Dial(context.Background())
	if err != nil {
		if refused := (*amqp.Error)(nil); amqpdial.Refused(err) && errors.As(err, &refused) {
			// The broker answered: it is not out of reach, it says no.
			return nil, fmt.Errorf("RabbitMQ at %s refused (%d): %s; %s", refusedAt(err, addrs), refused.Code, redact.String(refused.Reason), refusalAdvice(refused.Code))
		}
		var de *amqpdial.Error
		if !errors.As(err, &de) {
			return nil, fmt.Errorf("cannot reach RabbitMQ at %s: %s", addrs, cause(err, a.connectTimeout))
		}
		parts := make([]string, len(de.Attempts))
		for i, at := range de.Attempts {
			parts[i] = fmt.Sprintf("%s: %s", at.Addr, cause(at.Err, a.connectTimeout))
		}
		return nil, fmt.Errorf("cannot reach RabbitMQ at %s", strings.Join(parts, "; at "))
	}
	return conn, nil
}

// refusedAt is the (redacted) address whose broker refused the connection:
// a refusal ends a pass over the list, so it is the last one tried.
func refusedAt(err error, addrs amqpdial.Addrs) string {
	if de := (*amqpdial.Error)(nil); errors.As(err, &de) && len(de.Attempts) > 0 {
		return de.Attempts[len(de.Attempts)-1].Addr
	}
	return addrs.String()
}

// refusalAdvice says what to check when the broker refuses a connection
// with code (403 ACCESS_REFUSED, 530 NOT_ALLOWED).
func refusalAdvice(code int) string {
	if code == amqp.NotAllowed {
		return "check the vhost of --amqp-url, and that its user may open it (rabbitmqctl list_permissions -p VHOST)"
	}
	return "check the user and password of --amqp-url, and the user's permissions (rabbitmqctl list_user_permissions USER)"
}

// cause is the innermost, most telling part of a connection error, such as
// "connection refused", without the wrappers' repetitions.
func cause(err error, timeout time.Duration) string {
	if err == nil {
		return ""
	}
	var netErr net.Error
	if errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &netErr) && netErr.Timeout()) {
		return fmt.Sprintf("no answer within %s", timeout)
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return redact.String(pgErr.Error())
	}
	var amqpErr *amqp.Error
	if errors.As(err, &amqpErr) {
		return redact.String(amqpErr.Error())
	}
	inner := err
	for {
		switch u := inner.(type) { //nolint:errorlint // walks the chain itself, to its innermost error
		case interface{ Unwrap() error }:
			next := u.Unwrap()
			if next == nil {
				return redact.Error(inner)
			}
			inner = next
		case interface{ Unwrap() []error }:
			errs := u.Unwrap()
			if len(errs) == 0 {
				return redact.Error(inner)
			}
			inner = errs[0]
		default:
			return redact.Error(inner)
		}
	}
}
