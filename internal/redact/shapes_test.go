package redact_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/idemq/idemq/internal/redact"
)

// shape is a connection string (or a text holding some) with the secrets it
// carries and the parts an operator needs to tell the server.
type shape struct {
	in      string
	secrets []string
	keep    []string
	// text marks free text: only String and Error read it.
	text bool
}

// shapes is every connection-string shape Postgres, pgx and RabbitMQ accept,
// alone and in free text.
var shapes = []shape{
	// URLs, each scheme.
	{in: "postgres://app:Pw0rd9@db:5432/idemq", secrets: []string{"Pw0rd9"}, keep: []string{"postgres://", "db:5432/idemq"}},
	{in: "postgresql://app:Pw0rd9@db/idemq", secrets: []string{"Pw0rd9"}, keep: []string{"postgresql://", "@db/idemq"}},
	{in: "amqp://guest:Pw0rd9@node1:5672/", secrets: []string{"Pw0rd9"}, keep: []string{"amqp://", "@node1:5672/"}},
	{in: "amqps://user:Pw0rd9@broker:5671/vhost?heartbeat=10", secrets: []string{"Pw0rd9"}, keep: []string{"amqps://", "@broker:5671/vhost?heartbeat=10"}},
	// Unescaped reserved characters in the password: the userinfo runs to
	// the last '@' of the authority, whatever a parser makes of it.
	{in: "postgres://u:Pw@Tail99@h/db", secrets: []string{"Pw@Tail99", "Tail99"}, keep: []string{"@h/db"}},
	{in: "postgres://u:Pw:Tail99@h/db", secrets: []string{"Pw:Tail99", "Tail99"}, keep: []string{"@h/db"}},
	{in: "postgres://u:Pw/Tail99@h/db", secrets: []string{"Pw/Tail99", "Tail99"}, keep: []string{"@h/db"}},
	{in: "postgres://u:Pw#Tail99@h/db", secrets: []string{"Pw#Tail99", "Tail99"}, keep: []string{"@h/db"}},
	{in: "postgres://u:Pw?Tail99@h/db", secrets: []string{"Pw?Tail99", "Tail99"}, keep: []string{"@h/db"}},
	{in: "postgres://u:Pw%Tail99@h/db", secrets: []string{"Pw%Tail99", "Tail99"}, keep: []string{"@h/db"}},
	{in: "amqp://g:Pw@/?#:%Tail99@node1:5672/vh", secrets: []string{"Tail99"}, keep: []string{"@node1:5672/vh"}},
	{in: "postgres://u:Pw%40Tail99@h/db", secrets: []string{"Pw%40Tail99", "Tail99"}, keep: []string{"@h/db"}},
	// Query parameters that are secrets, and those that are paths.
	{in: "postgres://u@h/db?password=SECRET99", secrets: []string{"SECRET99"}, keep: []string{"@h/db?password="}},
	{in: "postgres://h/db?sslmode=verify-full&sslpassword=SECRET99&sslkey=/etc/key.pem", secrets: []string{"SECRET99"}, keep: []string{"postgres://h/db?sslmode=verify-full&sslpassword=", "sslkey=/etc/key.pem"}},
	{in: "postgres://h/db?passfile=/home/app/.pgpass&PASSWORD=SECRET99", secrets: []string{"SECRET99"}, keep: []string{"postgres://h/db?passfile=/home/app/.pgpass&PASSWORD="}},
	{in: "postgres://h/db?pass%77ord=SECRET99", secrets: []string{"SECRET99"}, keep: []string{"postgres://h/db?"}},
	{in: "amqps://h/?auth_token=SECRET99&client_secret=OTHER777&heartbeat=5", secrets: []string{"SECRET99", "OTHER777"}, keep: []string{"amqps://h/?auth_token=", "heartbeat=5"}},
	{in: "postgres://h/db?password=SEC@RET99", secrets: []string{"SEC@RET99", "RET99"}},
	{in: "postgres://u:p@h/db?password=SECRET99#frag", secrets: []string{"SECRET99"}, keep: []string{"@h/db?password="}},
	// Several hosts in one URL, several URLs in one string.
	{in: "postgres://u:Pw0rd9@h1:5432,h2:5432/db?target_session_attrs=read-write", secrets: []string{"Pw0rd9"}, keep: []string{"@h1:5432,h2:5432/db?target_session_attrs=read-write"}},
	{in: "amqp://g:Pw0rd9@n1:5672/,amqp://g:Other77@n2:5672/", secrets: []string{"Pw0rd9", "Other77"}, keep: []string{"@n1:5672/,", "@n2:5672/"}},
	{in: "amqp://n1:5672/,amqps://u:Pw@Tail99@n2:5671/vh", secrets: []string{"Tail99"}, keep: []string{"amqp://n1:5672/,", "@n2:5671/vh"}},
	{in: "amqp://g:Pw,Tail99@n1/,amqp://g:Pw,Tail99@n2/", secrets: []string{"Tail99"}, keep: []string{"@n1/,", "@n2/"}},
	// Key=value settings.
	{in: "host=db user=app password=SECRET99 dbname=x", secrets: []string{"SECRET99"}, keep: []string{"host=db", "dbname=x"}},
	{in: "host=db password = SECRET99 dbname=x", secrets: []string{"SECRET99"}, keep: []string{"host=db", "dbname=x"}},
	{in: "host=db password='s e c r e t' dbname=x", secrets: []string{"s e c r e t", "c r e"}, keep: []string{"host=db", "dbname=x"}},
	{in: `host=db password='it\'s SECRET99' dbname=x`, secrets: []string{"SECRET99", `s SECRET`}, keep: []string{"host=db", "dbname=x"}},
	{in: `host=db password=it\ SECRET99 dbname=x`, secrets: []string{"SECRET99"}, keep: []string{"host=db", "dbname=x"}},
	{in: "host=db PASSWORD=SECRET99 dbname=x", secrets: []string{"SECRET99"}, keep: []string{"host=db", "dbname=x"}},
	{in: "host=db sslkey=/k.pem sslpassword=SECRET99 dbname=x", secrets: []string{"SECRET99"}, keep: []string{"host=db", "sslkey=/k.pem", "dbname=x"}},
	{in: "host=db password='SECRET99 dbname=x", secrets: []string{"SECRET99"}, keep: []string{"host=db"}},
	{in: "host=db application_name=http://app/x password=SECRET99 dbname=x", secrets: []string{"SECRET99"}, keep: []string{"host=db", "dbname=x"}},
	{in: "host=db options='-c x=http://y' password=SECRET99 dbname=x", secrets: []string{"SECRET99"}, keep: []string{"host=db", "dbname=x"}},
	// Free text: errors and log lines quoting connection strings.
	{in: "dial postgres://app:Pw@Tail99@db/x: connection refused", secrets: []string{"Tail99"}, keep: []string{"@db/x: connection refused"}, text: true},
	{in: "cannot parse `postgres://u@h/db?password=SECRET99`: failed", secrets: []string{"SECRET99"}, keep: []string{"@h/db?password=", "`: failed"}, text: true},
	{in: "connect: host=db password=SECRET99 user=app: refused", secrets: []string{"SECRET99"}, keep: []string{"host=db", "user=app: refused"}, text: true},
	{in: "settings host=db Password = 'a b SECRET99' sslmode=require", secrets: []string{"SECRET99"}, keep: []string{"host=db", "sslmode=require"}, text: true},
	{in: `parse "amqp://g:Head77/Tail99@h/": invalid port ":Head77" after host`, secrets: []string{"Head77", "Tail99"}, keep: []string{`@h/": invalid port ":`, `" after host`}, text: true},
	{in: `parse "amqp://g:Head77%zzTail99@h/": invalid URL escape "%zz"`, secrets: []string{"Head77", "Tail99", "%zz"}, keep: []string{`@h/": invalid URL escape "`}, text: true},
	{in: "hostname resolving error: lookup Tail99@127.0.0.1: no such host", secrets: []string{"Tail99"}, keep: []string{"lookup ", "@127.0.0.1: no such host"}, text: true},
	{in: "PGPASSWORD=SECRET99 idemq migrate", secrets: []string{"SECRET99"}, keep: []string{"idemq migrate"}, text: true},
	{in: "brokers amqp://g:Pw0rd9@n1/,amqp://g:Other77@n2/ down; db postgres://u:Third777@db/x up", secrets: []string{"Pw0rd9", "Other77", "Third777"}, keep: []string{"@n1/,", "@n2/ down; db", "@db/x up"}, text: true},
}

func TestShapes(t *testing.T) {
	t.Parallel()
	for _, s := range shapes {
		outs := map[string]string{
			"String": redact.String(s.in),
			"Error":  redact.Error(errors.New(s.in)),
		}
		if !s.text {
			outs["URL"] = redact.URL(s.in)
			outs["DSN"] = redact.DSN(s.in)
		}
		for fn, got := range outs {
			for _, secret := range s.secrets {
				if strings.Contains(got, secret) {
					t.Errorf("%s(%q) = %q: holds %q", fn, s.in, got, secret)
				}
			}
			for _, keep := range s.keep {
				if !strings.Contains(got, keep) {
					t.Errorf("%s(%q) = %q: lost %q", fn, s.in, got, keep)
				}
			}
		}
	}
}

// TestStable checks that text without secrets comes out as it went in.
func TestStable(t *testing.T) {
	t.Parallel()
	for _, in := range []string{
		"",
		"connection refused",
		"postgres://127.0.0.1:5432/db?sslmode=disable",
		"postgres://h1:5432,h2:5432/db?target_session_attrs=read-write&passfile=/p&sslkey=/k",
		"amqp://node1:5672/,amqps://node2:5671/vh?heartbeat=10",
		"host=db user=app dbname=x sslmode=require sslkey=/k.pem passfile=/home/app/.pgpass",
		"failed to connect to `user=app database=x`: 127.0.0.1:1 (localhost): dial error: connect: connection refused",
		"FATAL: password authentication failed for user \"app\" (SQLSTATE 28P01)",
		"see https://www.postgresql.org/docs/current/libpq-connect.html#LIBPQ-CONNSTRING",
		`parse "amqp://h:5672x/": invalid port ":5672" after host`,
		"dial tcp: lookup db.internal: no such host",
		"AMQP scheme must be either 'amqp://' or 'amqps://'",
	} {
		for fn, got := range map[string]string{"String": redact.String(in), "Error": redact.Error(errors.New(in))} {
			if got != in {
				t.Errorf("%s(%q) = %q, want it unchanged", fn, in, got)
			}
		}
	}
	if got := redact.Error(nil); got != "" {
		t.Errorf("Error(nil) = %q", got)
	}
}

// TestIdempotent checks that redacting twice changes nothing more: a
// redacted text may be wrapped and redacted again.
func TestIdempotent(t *testing.T) {
	t.Parallel()
	for _, s := range shapes {
		once := redact.String(s.in)
		if twice := redact.String(once); twice != once {
			t.Errorf("String(%q) = %q, again %q", s.in, once, twice)
		}
	}
}

// TestDocumentedShapes checks the shapes the package doc shows.
func TestDocumentedShapes(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"postgres://app:p@ss@db:5432/idemq?sslmode=require&sslpassword=k3y": "postgres://xxxxx@db:5432/idemq?sslmode=require&sslpassword=xxxxx",
		"amqp://guest:guest@node1:5672/,amqp://node2:5672/":                 "amqp://xxxxx@node1:5672/,amqp://node2:5672/",
	} {
		if got := redact.URL(in); got != want {
			t.Errorf("URL(%q) = %q, want %q", in, got, want)
		}
	}
	in, want := `host=db user=app password='it\'s' dbname=idemq`, "host=db user=app password=xxxxx dbname=idemq"
	if got := redact.DSN(in); got != want {
		t.Errorf("DSN(%q) = %q, want %q", in, got, want)
	}
}
