package demo

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// workerProc is one worker process.
type workerProc struct {
	index   int
	cmd     *exec.Cmd
	stdin   io.WriteCloser
	logPath string
	exited  chan struct{}
	err     error // the result of Wait, once exited is closed
	// expected is set before the parent stops or kills the process itself.
	expected bool
}

// startWorker starts the running executable again, with the same arguments,
// as worker index.
func startWorker(wc workerConfig, logDir string) (*workerProc, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("start worker %d: find the executable: %w", wc.Index, err)
	}
	raw, err := json.Marshal(wc)
	if err != nil {
		return nil, fmt.Errorf("start worker %d: %w", wc.Index, err)
	}
	logPath := filepath.Join(logDir, fmt.Sprintf("worker-%d.log", wc.Index))
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, fmt.Errorf("start worker %d: %w", wc.Index, err)
	}
	defer logFile.Close()                    // the child holds its own descriptor
	cmd := exec.Command(exe, os.Args[1:]...) //nolint:noctx // the worker outlives calls; it stops on SIGTERM or when its stdin closes
	cmd.Env = append(os.Environ(), WorkerEnv+"="+string(raw))
	cmd.Stdout, cmd.Stderr = logFile, logFile
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, fmt.Errorf("start worker %d: %w", wc.Index, err)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start worker %d: %w", wc.Index, err)
	}
	w := &workerProc{index: wc.Index, cmd: cmd, stdin: stdin, logPath: logPath, exited: make(chan struct{})}
	go func() {
		w.err = cmd.Wait()
		close(w.exited)
	}()
	return w, nil
}

func (w *workerProc) pid() int { return w.cmd.Process.Pid }

func (w *workerProc) done() bool {
	select {
	case <-w.exited:
		return true
	default:
		return false
	}
}

// kill ends the worker with SIGKILL, as a crash would, and waits for it.
func (w *workerProc) kill() {
	w.expected = true
	_ = w.cmd.Process.Kill()
	<-w.exited
	_ = w.stdin.Close()
}

// stop asks the worker to drain and exit (SIGTERM; closing its stdin where
// signals are not available), and kills it after grace. It reports whether
// the worker stopped by itself, cleanly.
func (w *workerProc) stop(grace time.Duration) (clean bool) {
	w.expected = true
	if err := w.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		_ = w.stdin.Close()
	}
	select {
	case <-w.exited:
		_ = w.stdin.Close()
		return w.err == nil
	case <-time.After(grace):
		w.kill()
		return false
	}
}

// logTail returns the last lines of the worker's log, for error messages.
func (w *workerProc) logTail(lines int) string {
	b, err := os.ReadFile(w.logPath)
	if err != nil {
		return ""
	}
	all := strings.Split(string(bytes.TrimSpace(b)), "\n")
	if len(all) > lines {
		all = all[len(all)-lines:]
	}
	return strings.Join(all, "\n")
}
