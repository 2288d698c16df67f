package idemhttp

import (
	"errors"
	"fmt"
	"strings"
)

// parseKey returns the key a header value names. The Idempotency-Key draft
// makes the header an RFC 8941 Item whose bare item is an sf-string: a value
// that starts with DQUOTE (after leading spaces) is parsed as one (§4.2:
// the string, its parameters, nothing else), and the key is the string's
// content, escapes undone, so that "k" is the key k. Parameters are parsed
// and ignored (the draft defines none; RFC 8941 has fields ignore the ones
// they do not know). A value that does not start with DQUOTE is a bare key,
// taken as it is, as clients that predate the draft send it ("k;x" is the
// key k;x). The error never contains the value.
func parseKey(v string) (string, error) {
	s := strings.TrimLeft(v, " ")
	if !strings.HasPrefix(s, `"`) {
		return v, nil
	}
	p := sfParser{s: s}
	key, err := p.str()
	if err != nil {
		return "", err
	}
	if err := p.params(); err != nil {
		return "", err
	}
	p.spaces()
	if p.i < len(p.s) {
		return "", p.fail("unexpected text after the item (one key per header)")
	}
	return key, nil
}

// errSfString is what every parse failure wraps.
var errSfString = errors.New("not an RFC 8941 sf-string")

// sfParser reads an RFC 8941 Item from s, from byte i on.
type sfParser struct {
	s string
	i int
}

func (p *sfParser) fail(what string) error {
	return fmt.Errorf("%w: %s at byte %d", errSfString, what, p.i)
}

func (p *sfParser) peek() (byte, bool) {
	if p.i < len(p.s) {
		return p.s[p.i], true
	}
	return 0, false
}

func (p *sfParser) spaces() {
	for p.i < len(p.s) && p.s[p.i] == ' ' {
		p.i++
	}
}

// str parses an sf-string (§4.2.5): DQUOTE, then printable ASCII
// (%x20-7E) but for DQUOTE and backslash, which come escaped (\" and \\;
// no other escape exists), then DQUOTE.
func (p *sfParser) str() (string, error) {
	p.i++ // the opening DQUOTE
	var b strings.Builder
	for p.i < len(p.s) {
		c := p.s[p.i]
		switch {
		case c == '\\':
			p.i++
			if p.i >= len(p.s) {
				return "", p.fail("backslash at the end")
			}
			if e := p.s[p.i]; e != '"' && e != '\\' {
				return "", p.fail("escape of a character other than DQUOTE or backslash")
			}
			b.WriteByte(p.s[p.i])
		case c == '"':
			p.i++
			return b.String(), nil
		case c < 0x20 || c > 0x7e:
			return "", p.fail("a character other than printable ASCII")
		default:
			b.WriteByte(c)
		}
		p.i++
	}
	return "", p.fail("unterminated string")
}

// params parses the parameters that may follow a bare item (§4.2.3.2):
// ";" key ["=" bare item], repeated; SP may follow each ";".
func (p *sfParser) params() error {
	for {
		if c, ok := p.peek(); !ok || c != ';' {
			return nil
		}
		p.i++
		p.spaces()
		if err := p.paramKey(); err != nil {
			return err
		}
		if c, ok := p.peek(); ok && c == '=' {
			p.i++
			if err := p.bareItem(); err != nil {
				return err
			}
		}
	}
}

// paramKey parses a key (§4.2.3.3): lcalpha or "*", then lcalpha, DIGIT,
// "_", "-", "." or "*".
func (p *sfParser) paramKey() error {
	if c, ok := p.peek(); !ok || !(isLower(c) || c == '*') {
		return p.fail("a parameter key that does not start with a lowercase letter or *")
	}
	p.i++
	for p.i < len(p.s) {
		c := p.s[p.i]
		if !(isLower(c) || isDigit(c) || c == '_' || c == '-' || c == '.' || c == '*') {
			break
		}
		p.i++
	}
	return nil
}

// bareItem parses a parameter's value (§4.2.3.1): an integer or decimal,
// a string, a token, a byte sequence or a boolean.
func (p *sfParser) bareItem() error {
	c, ok := p.peek()
	switch {
	case !ok:
		return p.fail("a parameter without its value")
	case c == '-' || isDigit(c):
		return p.number()
	case c == '"':
		_, err := p.str()
		return err
	case isAlpha(c) || c == '*':
		p.i++
		for p.i < len(p.s) && (isTchar(p.s[p.i]) || p.s[p.i] == ':' || p.s[p.i] == '/') {
			p.i++
		}
		return nil
	case c == ':':
		return p.bytes()
	case c == '?':
		p.i++
		if c, ok := p.peek(); !ok || (c != '0' && c != '1') {
			return p.fail("a boolean other than ?0 or ?1")
		}
		p.i++
		return nil
	}
	return p.fail("a parameter value of no known type")
}

// number parses an integer (at most 15 digits) or a decimal (at most 12
// integer digits, 1 to 3 fraction digits) (§4.2.4).
func (p *sfParser) number() error {
	if p.s[p.i] == '-' {
		p.i++
	}
	if c, ok := p.peek(); !ok || !isDigit(c) {
		return p.fail("a number without digits")
	}
	intDigits, fracDigits, decimal := 0, 0, false
digits:
	for p.i < len(p.s) {
		c := p.s[p.i]
		switch {
		case isDigit(c) && decimal:
			fracDigits++
		case isDigit(c):
			intDigits++
		case c == '.' && !decimal:
			decimal = true
		default:
			break digits
		}
		p.i++
	}
	switch {
	case !decimal && intDigits > 15:
		return p.fail("an integer longer than 15 digits")
	case decimal && intDigits > 12:
		return p.fail("a decimal with more than 12 integer digits")
	case decimal && (fracDigits == 0 || fracDigits > 3):
		return p.fail("a decimal without 1 to 3 fraction digits")
	}
	return nil
}

// bytes parses a byte sequence (§4.2.7): ":", base64 characters, ":". Its
// content is not decoded: the value is ignored.
func (p *sfParser) bytes() error {
	p.i++
	for p.i < len(p.s) {
		c := p.s[p.i]
		p.i++
		switch {
		case c == ':':
			return nil
		case isAlpha(c) || isDigit(c) || c == '+' || c == '/' || c == '=':
		default:
			p.i--
			return p.fail("a byte sequence with a character outside base64")
		}
	}
	return p.fail("unterminated byte sequence")
}

func isLower(c byte) bool { return 'a' <= c && c <= 'z' }
func isAlpha(c byte) bool { return isLower(c) || 'A' <= c && c <= 'Z' }
func isDigit(c byte) bool { return '0' <= c && c <= '9' }

// isTchar reports an RFC 9110 tchar.
func isTchar(c byte) bool {
	return isAlpha(c) || isDigit(c) || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}
