// Package redact keeps secrets out of logs and errors.
//
// # What is a secret
//
// In a URL (postgres://, postgresql://, amqp://, amqps://, any scheme) the
// whole userinfo is: user and password become "xxxxx". The userinfo runs to
// the last '@' of the URL, not the first: a password with an unescaped '@',
// ':', '/', '?', '#' or '%' splits differently in every parser (pgx and libpq
// end it at the first '@', net/url and so amqp091-go at the last '@' before
// a '/', '?' or '#'), and its tail must not reach a log as "host". A query
// parameter is a secret when its (percent-decoded) name holds "password",
// "passwd", "pwd", "secret" or "token": password, sslpassword, auth_token.
// sslkey, sslcert and passfile are paths and stay.
//
// In key=value settings (host=db password='it\'s'), the value of every such
// key is a secret, quoted or not, in any case, with blanks around the '='.
//
// Errors quote pieces of a password without its URL: in Go's "lookup NAME"
// errors, NAME up to its last '@' (pgx takes the tail of a password with an
// '@' for the host), and net/url's `invalid port ":P"`
// and `invalid URL escape "%P"` quote the part of a password that broke the
// parse. Those pieces are masked too.
//
// # What stays
//
// Scheme, hosts, ports, database or vhost and the other parameters, so that
// a reader can tell which server it was. An '@' in a URL's path or query
// hides the hosts too: the redactor cannot tell it from one in a password.
//
// # Where a URL ends
//
// URL and DSN take the whole string as connection strings: a URL that starts
// it ends only where another begins (after a comma, a semicolon or blanks).
// String reads free text, where a URL also ends at a blank, unless it is in
// quotes: then it ends at the closing quote.
package redact

import (
	"regexp"
	"strings"
)

// mask replaces every secret.
const mask = "xxxxx"

// URL returns u, one connection URL or a list of them, with each URL's
// userinfo and secret query parameters replaced by "xxxxx", for logs. A
// string that is not a URL is redacted as key=value settings.
func URL(u string) string { return scan(u, true) }

// DSN returns a Postgres connection string for logs: a URL as URL redacts
// it, key=value settings with each secret's value replaced by "xxxxx".
func DSN(s string) string { return scan(s, true) }

// String removes the credentials of every URL and key=value setting in the
// free text s.
func String(s string) string { return scan(s, false) }

// Error returns err's text with credentials removed ("" for nil).
func Error(err error) string {
	if err == nil {
		return ""
	}
	return String(err.Error())
}

// secretWords are the parts of a setting's name that make its value secret.
const secretWords = `password|passwd|pwd|secret|token`

// start finds the next thing to redact: a URL's scheme (1), a secret
// setting's name and '=' (2), a host name holding an '@' in a resolver
// error (3, up to its last '@'), or the piece of a URL that net/url quotes
// in its errors (4 what, 5 the piece): a port that is not a number or a bad
// escape is part of a password with a reserved character.
var start = regexp.MustCompile(`(?i)\b([a-z][a-z0-9+.-]*://)` +
	`|\b([a-z0-9_.-]*(?:` + secretWords + `)[a-z0-9_.-]*\s*=\s*)` +
	`|\blookup (\S*)@` +
	`|\binvalid (port|URL escape) "((?:[^"\\]|\\.)*)"`)

// port is a port as net/url quotes it.
var port = regexp.MustCompile(`^:?[0-9]*$`)

// nextURL finds where another URL of a list begins.
var nextURL = regexp.MustCompile("[,;\\s\"'`]+[a-zA-Z][a-zA-Z0-9+.-]*://")

// scan redacts s. whole says s is connection strings only, so that a URL
// that starts s, and each URL of a list after it, runs on across blanks (a
// password may hold them).
func scan(s string, whole bool) string {
	var b strings.Builder
	b.Grow(len(s))
	done := 0       // s[:done] is written
	listed := whole // the next URL may start a list of URLs or go on with one
	for done < len(s) {
		m := start.FindStringSubmatchIndex(s[done:])
		if m == nil {
			break
		}
		for i := range m {
			if m[i] >= 0 {
				m[i] += done
			}
		}
		b.WriteString(s[done:m[0]])
		switch {
		case m[2] >= 0: // a URL
			var quote byte
			if m[2] > 0 {
				quote = s[m[2]-1]
			}
			// Only a URL that is the string, or one of its list, runs on
			// across blanks; one in a setting's value ends like the value.
			listed = listed && strings.TrimLeft(s[done:m[0]], ",; \t\r\n\v\f") == ""
			end := m[3] + urlEnd(s[m[3]:], listed, quote)
			b.WriteString(s[m[2]:m[3]])
			b.WriteString(urlBody(s[m[3]:end]))
			done = end
		case m[4] >= 0: // key=value
			b.WriteString(s[m[4]:m[5]])
			n := settingValue(s[m[5]:])
			if n > 0 {
				b.WriteString(mask)
			}
			done = m[5] + n
			listed = false
		case m[6] >= 0: // lookup user:pass@host
			b.WriteString(s[m[0]:m[6]])
			b.WriteString(mask + "@")
			done = m[1]
			listed = false
		default: // invalid port ":pass"
			piece := s[m[10]:m[11]]
			b.WriteString(s[m[0]:m[10]])
			switch {
			case s[m[8]:m[9]] == "port" && port.MatchString(piece):
				b.WriteString(piece)
			case strings.HasPrefix(piece, ":"):
				b.WriteString(":" + mask)
			default:
				b.WriteString(mask)
			}
			b.WriteString(s[m[11]:m[1]])
			done = m[1]
			listed = false
		}
	}
	b.WriteString(s[done:])
	return b.String()
}

// urlEnd is the length of the URL whose scheme and "://" precede s: up to
// where the next URL of a list begins, or, in free text, a blank. A URL in
// quotes (quote, the byte before it) ends at its closing quote, and a blank
// or a quote in its password stays inside: a double quote closes at the
// first one not escaped with a backslash (Go's %q, as in net/url's
// errors), a backtick (pgx's errors) or a single quote at the last one
// before the end of the line or the next URL.
func urlEnd(s string, whole bool, quote byte) int {
	quoted := quote == '`' || quote == '"' || quote == '\''
	end := len(s)
	if !whole && quoted {
		if i := strings.IndexByte(s, '\n'); i >= 0 {
			end = i
		}
	}
	if !whole && !quoted {
		end = blank(s)
	}
	if quote == '"' {
		for i := 0; i < end; i++ {
			switch s[i] {
			case '\\':
				i++
			case '"':
				return i
			}
		}
	}
	if loc := nextURL.FindStringIndex(s[:end]); loc != nil {
		end = loc[0]
	}
	if quoted {
		if i := strings.LastIndexByte(s[:end], quote); i >= 0 && quote != '"' {
			return i
		}
		if !whole {
			end = blank(s[:end])
		}
	}
	return end
}

// blank is the index of the first blank in s, or len(s).
func blank(s string) int {
	if i := strings.IndexAny(s, " \t\r\n\v\f"); i >= 0 {
		return i
	}
	return len(s)
}

// urlBody redacts a URL after its "://": the userinfo up to the last '@',
// and the value of every query parameter whose name is a secret's, up to
// the next '&'. Where the two overlap (an '@' in a secret value), both and
// what lies between go.
func urlBody(body string) string {
	secret := make([]bool, len(body))
	if at := strings.LastIndexByte(body, '@'); at > 0 {
		for i := range at {
			secret[i] = true
		}
	}
	for i := 0; i < len(body); i++ {
		if body[i] != '?' && body[i] != '&' {
			continue
		}
		rest := body[i+1:]
		eq := strings.IndexAny(rest, "=&?")
		if eq < 0 || rest[eq] != '=' || !secretName(rest[:eq]) {
			continue
		}
		from := i + 1 + eq + 1
		to := len(body)
		if j := strings.IndexByte(body[from:], '&'); j >= 0 {
			to = from + j
		}
		for k := from; k < to; k++ {
			secret[k] = true
		}
		i = to - 1
	}
	var b strings.Builder
	b.Grow(len(body))
	for i := 0; i < len(body); i++ {
		if !secret[i] {
			b.WriteByte(body[i])
			continue
		}
		b.WriteString(mask)
		for i+1 < len(body) && secret[i+1] {
			i++
		}
	}
	return b.String()
}

// secretWord matches a setting's name that makes its value secret.
var secretWord = regexp.MustCompile(`(?i)` + secretWords)

// secretName reports whether a query parameter's raw name, percent-decoded
// as pgx decodes it (leniently), is a secret's.
func secretName(raw string) bool {
	return secretWord.MatchString(unescape(raw))
}

// unescape decodes %XX sequences, leaving any other '%' as it is.
func unescape(s string) string {
	if !strings.Contains(s, "%") {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '%' && i+2 < len(s) && isHex(s[i+1]) && isHex(s[i+2]) {
			b.WriteByte(unhex(s[i+1])<<4 | unhex(s[i+2]))
			i += 2
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

func unhex(c byte) byte {
	switch {
	case c <= '9':
		return c - '0'
	case c <= 'F':
		return c - 'A' + 10
	default:
		return c - 'a' + 10
	}
}

// settingValue is the length of the value that starts s in key=value
// settings, read as libpq reads it: quoted ('...', with backslash escapes;
// unterminated, to the end) or up to a blank (a backslash escapes one).
func settingValue(s string) int {
	if s == "" {
		return 0
	}
	if s[0] == '\'' {
		for i := 1; i < len(s); i++ {
			switch s[i] {
			case '\\':
				i++
			case '\'':
				return i + 1
			}
		}
		return len(s)
	}
	i := 0
	for i < len(s) && !isBlank(s[i]) {
		if s[i] == '\\' {
			i++
		}
		i++
	}
	return min(i, len(s))
}

func isBlank(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'
}
