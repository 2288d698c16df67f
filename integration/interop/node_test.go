package interop_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testamqp"
)

// nodeDir is where testdata/node's packages are installed: one directory
// per package-lock.json, in the user's cache.
func nodeDir(t *testing.T) string {
	t.Helper()
	lock, err := os.ReadFile(filepath.Join("testdata", "node", "package-lock.json"))
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(lock)
	cache, err := os.UserCacheDir()
	if err != nil {
		t.Fatalf("no cache directory for the node packages: %v", err)
	}
	return filepath.Join(cache, "idemq", "node", hex.EncodeToString(sum[:8]))
}

// installNode returns the node_modules directory of testdata/node,
// installing it with npm ci the first time: into a directory of its own,
// renamed into place when complete, so that test processes running at
// once never see half an install.
func installNode(t *testing.T) string {
	t.Helper()
	if _, err := exec.LookPath("node"); err != nil {
		t.Fatal("node is not on PATH: run deploy/local/ensure-node.sh (make test does)")
	}
	dir := nodeDir(t)
	modules := filepath.Join(dir, "node_modules")
	if _, err := os.Stat(filepath.Join(modules, ".package-lock.json")); err == nil {
		return modules
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		t.Fatal(err)
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dir), "install-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(tmp)
	for _, f := range []string{"package.json", "package-lock.json"} {
		b, err := os.ReadFile(filepath.Join("testdata", "node", f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(tmp, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "npm", "ci", "--no-audit", "--no-fund", "--ignore-scripts", "--loglevel=error")
	cmd.Dir = tmp
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("npm ci of testdata/node (needs the npm registry the first time): %v\n%s", err, out)
	}
	// Another process may have won the race: its install is as good.
	if err := os.Rename(tmp, dir); err != nil {
		if _, serr := os.Stat(filepath.Join(modules, ".package-lock.json")); serr != nil {
			t.Fatalf("install node packages into %s: %v", dir, err)
		}
	}
	return modules
}

// node runs testdata/node/interop.js with args against queue and returns
// its standard output.
func node(t *testing.T, modules, queue string, args ...string) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "node", append([]string{filepath.Join("testdata", "node", "interop.js")}, args...)...)
	cmd.Env = append(os.Environ(), "NODE_PATH="+modules, "AMQP_URL="+testamqp.URL(), "QUEUE="+queue)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("node interop.js %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
	}
	return out
}

// nodeEvent is what interop.js read prints of each event the SDK decoded.
type nodeEvent struct {
	SpecVersion     string          `json:"specversion"`
	ID              string          `json:"id"`
	Source          string          `json:"source"`
	Type            string          `json:"type"`
	DataContentType string          `json:"datacontenttype"`
	Data            json.RawMessage `json:"data"`
	MessageID       string          `json:"message_id"`
}

func decodeEvents(t *testing.T, out []byte) []nodeEvent {
	t.Helper()
	var evs []nodeEvent
	for line := range bytes.Lines(out) {
		var ev nodeEvent
		if err := json.Unmarshal(line, &ev); err != nil {
			t.Fatalf("interop.js printed %q: %v", line, err)
		}
		evs = append(evs, ev)
	}
	return evs
}
