package chaos

import (
	"os"
	"strconv"
	"testing"
)

// intEnv reads a whole number from the environment, def when unset.
func intEnv(t testing.TB, name string, def int) int {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		t.Fatalf("%s=%q: want a whole number", name, v)
	}
	return n
}
