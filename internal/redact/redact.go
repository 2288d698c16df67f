// Package redact keeps secrets out of logs and errors.
package redact

import (
	"net/url"
	"regexp"
	"strings"
)

// userinfo matches the credentials part of any URL in free text.
var userinfo = regexp.MustCompile(`([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]*@`)

// URL returns u with its password (and user) replaced by "xxxxx", for logs.
// A string that does not parse as a URL, or that holds several (a list of
// broker addresses), is redacted as free text.
func URL(u string) string {
	if strings.Count(u, "://") > 1 {
		return String(u)
	}
	parsed, err := url.Parse(u)
	if err != nil || parsed.User == nil {
		return String(u)
	}
	parsed.User = url.User("xxxxx")
	return parsed.String()
}

// dsnPassword matches a password in a key=value connection string.
var dsnPassword = regexp.MustCompile(`(?i)(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)`)

// DSN returns a Postgres connection string for logs: a URL as URL redacts
// it, a key=value string with its password replaced by "xxxxx".
func DSN(s string) string {
	if strings.Contains(s, "://") {
		return URL(s)
	}
	return dsnPassword.ReplaceAllString(s, "${1}xxxxx")
}

// String removes the credentials of every URL in s.
func String(s string) string {
	return userinfo.ReplaceAllString(s, "${1}xxxxx@")
}

// Error returns err's text with credentials removed ("" for nil).
func Error(err error) string {
	if err == nil {
		return ""
	}
	return String(err.Error())
}
