package idemhttp

import (
	"errors"
	"strings"
	"testing"
)

// quote writes key as an sf-string (RFC 8941 §4.1.6).
func quote(key string) string {
	return `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(key) + `"`
}

func TestParseKey(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ in, want string }{
		{`k`, `k`},
		{`"k"`, `k`},
		{`  "k"  `, `k`},
		{`"a\"b\\c"`, `a"b\c`},
		{`""`, ``},
		{`"k";a`, `k`},
		{`"k";a;b=1;c=-1.5;d=?0;e="x;y";f=tok/en:1;g=:YWJj:;*h=*`, `k`},
		{`k;a="`, `k;a="`}, // a bare key is taken as it is
		{` k`, ` k`},
	} {
		got, err := parseKey(c.in)
		if err != nil || got != c.want {
			t.Errorf("parseKey(%s) = %q, %v; want %q", c.in, got, err, c.want)
		}
	}
	for _, in := range []string{
		`"k`, `"k\`, `"k\n"`, `"é"`, "\"k\x7f\"", `"k"x`, `"k" x`, `"k","j"`, `"k" ;a`, `"k";`, `"k";A`, `"k";1a`,
		`"k";a=`, `"k";a=-`, `"k";a=1.`, `"k";a=1.2345`, `"k";a=1234567890123.1`, `"k";a=1234567890123456`,
		`"k";a=?2`, `"k";a=:abc`, `"k";a=:a$:`, `"k";a="x`, `"k";a=@1`, `"k";a==`,
	} {
		got, err := parseKey(in)
		if !errors.Is(err, errSfString) {
			t.Errorf("parseKey(%s) = %q, %v; want a parse error", in, got, err)
		}
	}
}

// Every key of printable ASCII reads back from its sf-string, and nothing
// makes parseKey panic.
func FuzzParseKey(f *testing.F) {
	for _, s := range []string{"k", `a"b\c`, "order-1", "", `"`, `\`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		_, _ = parseKey(s)
		if strings.ContainsFunc(s, func(r rune) bool { return r < 0x20 || r > 0x7e }) {
			return
		}
		got, err := parseKey(quote(s))
		if err != nil || got != s {
			t.Fatalf("parseKey(quote(%q)) = %q, %v", s, got, err)
		}
	})
}
