package gateway

import "testing"

func TestPatternMatchesAsATopicExchange(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		pattern, key string
		ok           bool
	}{
		{"orders", "orders", true},
		{"orders", "orders.created", false},
		{"orders.*", "orders.created", true},
		{"orders.*", "orders", false},
		{"orders.*", "orders.created.eu", false},
		{"*.created", "orders.created", true},
		{"orders.#", "orders", true},
		{"orders.#", "orders.created.eu", true},
		{"orders.#", "ordersx.created", false},
		{"#", "", true},
		{"#", "a.b.c", true},
		{"#.eu", "orders.created.eu", true},
		{"#.eu", "eu", true},
		{"#.eu", "orders.eu.created", false},
		{"a.#.z", "a.z", true},
		{"a.#.z", "a.b.c.z", true},
		{"a.#.z", "a.b.c", false},
		{"*", "", true}, // the empty key is one empty word
		{"a.*.#", "a", false},
		{"a.*.#", "a.b", true},
	} {
		p, err := parsePattern(tc.pattern)
		if err != nil {
			t.Fatalf("parse %q: %v", tc.pattern, err)
		}
		if got := p.match(tc.key); got != tc.ok {
			t.Errorf("%q matches %q: %v, want %v", tc.pattern, tc.key, got, tc.ok)
		}
	}
	for _, bad := range []string{"order*", "orders.cre#", "a.**"} {
		if _, err := parsePattern(bad); err == nil {
			t.Errorf("parse %q: no error", bad)
		}
	}
}
