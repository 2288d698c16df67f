package chaos

import (
	"os"
	"testing"
)

// TestMain doubles as a worker process of the soak (see runWorker).
func TestMain(m *testing.M) {
	if raw, ok := os.LookupEnv(workerEnv); ok {
		os.Exit(runWorker(raw))
	}
	os.Exit(m.Run())
}
