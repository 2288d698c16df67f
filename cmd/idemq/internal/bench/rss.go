package bench

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"
)

// runMeasured runs cmd to its end and returns its resource usage, with the
// peak RSS of its own program. The kernel's ru_maxrss of a child is no such
// figure: os/exec starts it with CLONE_VM, and exec keeps the high-water mark
// of the memory it leaves, the parent's, so every child would show at least
// the bench's own RSS. VmHWM of /proc/<pid>/status belongs to the program
// exec loaded; it is read while the child runs (it only grows, so the last
// reading is its peak, to within the polling interval).
func runMeasured(cmd *exec.Cmd) (*syscall.Rusage, error) {
	wait, err := startMeasured(cmd)
	if err != nil {
		return nil, err
	}
	return wait()
}

// startMeasured starts cmd; wait waits for its end and returns what
// runMeasured does.
func startMeasured(cmd *exec.Cmd) (wait func() (*syscall.Rusage, error), err error) {
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	stop := make(chan struct{})
	peak := make(chan int64, 1)
	go func() {
		status := filepath.Join("/proc", strconv.Itoa(cmd.Process.Pid), "status")
		var hwm int64
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			if v, ok := readHWM(status); ok {
				hwm = max(hwm, v)
			}
			select {
			case <-stop:
				peak <- hwm
				return
			case <-tick.C:
			}
		}
	}()
	return func() (*syscall.Rusage, error) {
		err := cmd.Wait()
		close(stop)
		hwm := <-peak
		usage, _ := cmd.ProcessState.SysUsage().(*syscall.Rusage)
		if usage != nil {
			// Unknown (no /proc, or a child too short to be read) reads 0.
			usage.Maxrss = hwm
		}
		return usage, err
	}, nil
}

// readHWM reads VmHWM (KiB) from a /proc/<pid>/status file.
func readHWM(path string) (int64, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	_, rest, ok := bytes.Cut(b, []byte("\nVmHWM:"))
	if !ok {
		return 0, false
	}
	line, _, _ := bytes.Cut(rest, []byte("\n"))
	f := bytes.Fields(line)
	if len(f) == 0 {
		return 0, false
	}
	n, err := strconv.ParseInt(string(f[0]), 10, 64)
	return n, err == nil
}
