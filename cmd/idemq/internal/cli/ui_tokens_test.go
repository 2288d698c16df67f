package cli

import (
	"strings"
	"testing"
)

func TestParseTokens(t *testing.T) {
	got, err := parseTokens("# operators\nalice 0123456789abcdef-alice\n\n  bob   0123456789abcdef-bob  \n")
	if err != nil || len(got) != 2 || got[0].Name != "alice" || got[0].Secret != "0123456789abcdef-alice" || got[1].Name != "bob" {
		t.Fatalf("named tokens: %+v %v", got, err)
	}
	if got, err := parseTokens("0123456789abcdef-only\n"); err != nil || len(got) != 1 || got[0].Name != "token" {
		t.Fatalf("a lone token: %+v %v", got, err)
	}
	for text, want := range map[string]string{
		"":                                       "no token",
		"alice short":                            "at least 16 characters",
		"a b c":                                  "want NAME TOKEN",
		"a 0123456789abcdef\na 0123456789abcdeg": "given twice",
		"a 0123456789abcdef\nb 0123456789abcdef": "given twice",
	} {
		if _, err := parseTokens(text); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("parseTokens(%q): %v, want %q", text, err, want)
		}
	}
}
