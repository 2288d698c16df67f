package integration

import (
	"os"
	"testing"

	"github.com/idemq/idemq/internal/testjaeger"
)

// TestMain stops the test binary's own Jaeger, if a test started one.
func TestMain(m *testing.M) {
	code := m.Run()
	testjaeger.Stop()
	os.Exit(code)
}
