package chaos

import (
	"fmt"
	"os"
	"testing"
)

// TestMain doubles as a worker process of the soak (see runWorker). After
// the tests it stops the private services the run started.
func TestMain(m *testing.M) {
	if raw, ok := os.LookupEnv(workerEnv); ok {
		os.Exit(runWorker(raw))
	}
	code := m.Run()
	if err := stopPrivateServices(); err != nil {
		fmt.Fprintf(os.Stderr, "chaos: the private services this run started did not stop: %v\n", err)
		code = 1
	}
	os.Exit(code)
}
