package redact_test

import (
	"errors"
	"net/url"
	"strconv"
	"strings"
	"testing"

	"github.com/idemq/idemq/internal/redact"
)

// template builds one connection-string shape from a user, the password as
// written in it (escaped as the shape needs) and a host.
type template struct {
	name string
	// build returns the text, or ok false when the shape cannot carry the
	// values (a blank in a free-text URL, say: see the package doc).
	build func(user, pw, host string) (text string, secret []string, ok bool)
	// text marks free text: only String and Error read it.
	text bool
}

func raw(f func(u, p, h string) string) func(u, p, h string) (string, []string, bool) {
	return func(u, p, h string) (string, []string, bool) { return f(u, p, h), []string{p}, true }
}

func noBlank(s ...string) bool {
	for _, x := range s {
		if strings.ContainsAny(x, " \t\r\n\v\f") {
			return false
		}
	}
	return true
}

var templates = []template{
	{name: "postgres", build: raw(func(u, p, h string) string { return "postgres://" + u + ":" + p + "@" + h + ":5432/db" })},
	{name: "postgresql", build: raw(func(u, p, h string) string { return "postgresql://" + u + ":" + p + "@" + h + "/db?sslmode=require" })},
	{name: "amqp", build: raw(func(u, p, h string) string { return "amqp://" + u + ":" + p + "@" + h + ":5672/vh" })},
	{name: "amqps list", build: raw(func(u, p, h string) string {
		return "amqps://" + u + ":" + p + "@" + h + "/,amqp://" + u + ":" + p + "@n2:5672/"
	})},
	{name: "multi-host", build: raw(func(u, p, h string) string { return "postgres://" + u + ":" + p + "@h1:5432," + h + ":5433/db" })},
	{name: "escaped userinfo", build: func(u, p, h string) (string, []string, bool) {
		e := url.UserPassword(u, p).String()
		return "postgres://" + e + "@" + h + "/db", []string{p, e}, true
	}},
	{name: "query password", build: func(u, p, h string) (string, []string, bool) {
		// A raw '&' ends the value for pgx too.
		return "postgres://" + u + "@" + h + "/db?sslmode=disable&password=" + p, []string{p}, !strings.Contains(p, "&")
	}},
	{name: "query sslpassword escaped", build: func(u, p, h string) (string, []string, bool) {
		e := url.QueryEscape(p)
		return "postgres://" + h + "/db?sslpassword=" + e + "&sslkey=/k.pem", []string{p, e}, true
	}},
	{name: "dsn", build: func(u, p, h string) (string, []string, bool) {
		ok := noBlank(p) && !strings.ContainsAny(p, `\'`)
		return "host=" + h + " user=" + u + " password=" + p + " dbname=db", []string{p}, ok
	}},
	{name: "dsn quoted", build: func(u, p, h string) (string, []string, bool) {
		e := strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(p)
		return "host=" + h + " user=" + u + " PASSWORD = '" + e + "' dbname=db", []string{p, e}, true
	}},
	{name: "text url", text: true, build: func(u, p, h string) (string, []string, bool) {
		return "dial postgres://" + u + ":" + p + "@" + h + "/db: connection refused", []string{p}, noBlank(u, p)
	}},
	{name: "text pgx", text: true, build: func(u, p, h string) (string, []string, bool) {
		// pgx quotes in backticks, and a blank stays inside.
		return "cannot parse `postgres://" + u + ":" + p + "@" + h + "/db`: invalid port", []string{p}, !strings.Contains(p, "\n")
	}},
	{name: "text net/url", text: true, build: func(u, p, h string) (string, []string, bool) {
		q := strconv.Quote("amqp://" + u + ":" + p + "@" + h + "/")
		e := strconv.Quote(p)
		return "parse " + q + ": net/url: invalid userinfo", []string{p, e[1 : len(e)-1]}, true
	}},
	{name: "text amqp list", text: true, build: func(u, p, h string) (string, []string, bool) {
		return "brokers amqp://" + h + "/,amqp://" + u + ":" + p + "@" + h + "/ down", []string{p}, noBlank(u, p, h)
	}},
	{name: "text net/url port", text: true, build: func(u, p, h string) (string, []string, bool) {
		// net/url quotes the part of a password before a '/' as the port,
		// when it is not a number.
		e := strconv.Quote(p)
		return "parse " + strconv.Quote("amqp://"+u+":"+p+"/x@"+h+"/") + ": invalid port " + strconv.Quote(":"+p) + " after host",
			[]string{p, e[1 : len(e)-1]}, strings.Trim(p, "0123456789") != ""
	}},
	{name: "text dsn", text: true, build: func(u, p, h string) (string, []string, bool) {
		e := strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(p)
		return "connect: host=" + h + " sslpassword='" + e + "' user=" + u + ": refused", []string{p, e}, true
	}},
	{name: "text lookup", text: true, build: func(u, p, h string) (string, []string, bool) {
		// pgx takes what follows the first '@' of a password for the host.
		return "hostname resolving error: lookup " + p + "@" + h + ": no such host", []string{p}, noBlank(p)
	}},
}

// FuzzRedact builds every shape from a fuzzed user, password and host and
// checks that no redaction of it holds the password.
func FuzzRedact(f *testing.F) {
	for _, seed := range [][3]string{
		{"app", "s3cret99", "db"},
		{"app", "Pw@Tail99", "db"},
		{"u", "Pw:Tail:99", "h"},
		{"u", "Pw/Tail?99#x", "h"},
		{"u", "50%off%zz!", "h"},
		{"guest", "a,amqp99", "node1"},
		{"u", "it's a secret", "h"},
		{"u", `back\slash'q`, "h"},
		{"u@x", "p@ss@word", "h@y"},
		{"", "password=xx", "[::1]"},
		{"u", "&token=abcdef", "h"},
		{"u", "'quoted'", "h"},
		{"u", "é秘密パスワード", "h"},
	} {
		f.Add(seed[0], seed[1], seed[2])
	}
	f.Fuzz(func(t *testing.T, user, pw, host string) {
		if len(pw) < 6 || strings.Contains(pw, "://") || strings.Contains(user, "://") || strings.Contains(host, "://") {
			return
		}
		// A user or host that reads as a setting or quote of its own is not
		// a server's: the shapes assume plain ones.
		if strings.ContainsAny(user+host, `'"=\`+"`") || !noBlank(user, host) {
			return
		}
		for _, tp := range templates {
			in, secrets, ok := tp.build(user, pw, host)
			if !ok {
				continue
			}
			fns := map[string]func(string) string{
				"String": redact.String,
				"Error":  func(s string) string { return redact.Error(errors.New(s)) },
			}
			if !tp.text {
				fns["URL"] = redact.URL
				fns["DSN"] = redact.DSN
				if !noBlank(user, pw) {
					// In free text a URL not in quotes ends at a blank.
					delete(fns, "String")
					delete(fns, "Error")
				}
			}
			rest, _, _ := tp.build(user, "xxxxx", host)
			for fn, redactFn := range fns {
				got := redactFn(in)
				for _, secret := range secrets {
					// The secret must stand out: not elsewhere in the text,
					// not in what the redactor makes of a masked one.
					if len(secret) < 6 || !strings.Contains(got, secret) || strings.Contains(rest, secret) || strings.Contains(redactFn(rest), secret) {
						continue
					}
					t.Errorf("%s: %s(%q) = %q: holds %q", tp.name, fn, in, got, secret)
				}
			}
		}
	})
}
