package bench

import (
	"os"
	"os/exec"
	"testing"
)

// The peak RSS of a child is its own, not the bench's: this test holds
// 64 MiB while a small child runs.
func TestRunMeasuredPeakRSS(t *testing.T) {
	if _, err := os.Stat("/proc/self/status"); err != nil {
		t.Skip("no /proc: peak RSS is Linux only")
	}
	ballast := make([]byte, 64<<20)
	for i := range ballast {
		ballast[i] = 1
	}
	usage, err := runMeasured(exec.Command("sleep", "0.2"))
	if err != nil {
		t.Fatal(err)
	}
	if usage.Maxrss <= 0 || usage.Maxrss > 32<<10 {
		t.Errorf("peak RSS of sleep: %d KiB, want its own (a few MiB), not this test's (%d MiB held)", usage.Maxrss, len(ballast)>>20)
	}
}
