package redact_test

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/redact"
)

// TestPgxParseErrors runs pgx's own errors for malformed connection strings
// through Error: pgconn masks what it recognises, and the rest must go too.
func TestPgxParseErrors(t *testing.T) {
	t.Parallel()
	const head, secret = "Head77", "Tail99secret"
	for _, in := range []string{
		// pgx splits the userinfo at the first '@' (libpq too): the rest
		// of the password lands in the host, past pgx's own masking.
		"postgres://u:" + head + "@" + secret + "@h/db?sslmode=bogus",
		"postgres://u:" + head + "/" + secret + "@h/db",
		"postgres://u:" + head + "?" + secret + "@h/db?sslmode=bogus",
		"postgres://u:" + head + ":" + secret + "@h/db?sslmode=bogus",
		"postgres://u:" + head + "%zz" + secret + "@h/db",
		"postgres://u:" + head + "%" + secret + "@h:5432/db",
		"postgres://u:" + secret + "@h:notaport/db",
		"postgres://u:" + secret + "@h/db?sslmode=bogus",
		"postgres://u@h/db?password=" + secret + "&target_session_attrs=bogus",
		"postgres://u@h/db?sslpassword=" + secret + "&sslmode=bogus",
		"postgres://u@h/db?pass%77ord=" + secret + "&channel_binding=bogus",
		"postgres://u:" + secret + "@[::1/db",
		"host=h password=" + secret + " sslmode=bogus",
		"host=h password='" + secret + " sslmode=require",
		"host=h PASSWORD=" + secret + " target_session_attrs=bogus",
		"host=h sslpassword=" + secret + " sslmode=bogus",
		"host=h password = " + secret + " port=x",
	} {
		_, err := pgxpool.ParseConfig(in)
		if err == nil {
			t.Errorf("ParseConfig(%q): nil error", in)
			continue
		}
		if got := redact.Error(err); strings.Contains(got, head) || strings.Contains(got, "Tail99") {
			t.Errorf("ParseConfig(%q): %q redacted as %q", in, err, got)
		}
	}
}

// TestPgxConnectError checks a connect error from pgx to a closed port:
// pgx names the user and database, the address and the cause, never the
// password, and redaction keeps what tells the server apart.
func TestPgxConnectError(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	const head, secret = "Head77", "Tail99secret"
	for _, in := range []string{
		"postgres://app:" + head + "@" + secret + "@" + addr + "/idemq?sslmode=disable&connect_timeout=5",
		"host=127.0.0.1 port=" + addr[strings.LastIndexByte(addr, ':')+1:] + " user=app password='" + secret + "' dbname=idemq sslmode=disable",
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		conn, err := pgconn.Connect(ctx, in)
		cancel()
		if err == nil {
			_ = conn.Close(context.Background())
			t.Fatalf("connect to closed %s: nil error", addr)
		}
		got := redact.Error(err)
		if strings.Contains(got, head) || strings.Contains(got, "Tail99") {
			t.Errorf("connect error %q redacted as %q", err, got)
		}
		if !strings.Contains(got, "127.0.0.1") || !strings.Contains(got, "idemq") {
			t.Errorf("connect error %q redacted as %q: server lost", err, got)
		}
		if got != err.Error() && !strings.Contains(err.Error(), "Tail99") {
			t.Errorf("connect error without a secret changed: %q → %q", err, got)
		}
	}
}

// TestAMQPParseErrors runs amqp091-go's errors for malformed URLs through
// Error.
func TestAMQPParseErrors(t *testing.T) {
	t.Parallel()
	const head, secret = "Head77", "Tail99secret"
	for _, in := range []string{
		"amqp://g:" + head + "@" + secret + "@h:notaport/",
		"amqp://g:" + secret + "@h:notaport/",
		"amqp://g:" + head + "/" + secret + "@h/",
		"amqp://g:" + head + "%zz" + secret + "@h/",
		"amqpx://g:" + secret + "@h/",
	} {
		_, err := amqp.ParseURI(in)
		if err == nil {
			t.Errorf("ParseURI(%q): nil error", in)
			continue
		}
		if got := redact.Error(err); strings.Contains(got, head) || strings.Contains(got, "Tail99") {
			t.Errorf("ParseURI(%q): %q redacted as %q", in, err, got)
		}
	}
}
