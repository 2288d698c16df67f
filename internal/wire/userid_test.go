package wire_test

import (
	"testing"

	"github.com/idemq/idemq/internal/wire"
)

func TestUserIDAllowed(t *testing.T) {
	for _, c := range []struct {
		userID, user string
		want         bool
	}{
		{"", "guest", true},
		{"", "", true},
		{"guest", "guest", true},
		{"alice", "guest", false},
		{"alice", "", false}, // an unknown user (a certificate login) proves nothing
	} {
		if got := wire.UserIDAllowed(c.userID, c.user); got != c.want {
			t.Errorf("UserIDAllowed(%q, %q) = %v, want %v", c.userID, c.user, got, c.want)
		}
	}
}
