package bench

import (
	"context"
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"
)

// TestMain makes the test binary a bench worker when Run re-executes it
// (as it re-executes idemq), and checks that the tests leave no goroutine.
func TestMain(m *testing.M) {
	if isWorker, err := maybeWorker(context.Background()); isWorker {
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}
