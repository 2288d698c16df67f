package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/internal/redact"
)

// The reference consumers (shared/benchref) and the peers (bench/watermill,
// bench/river) are modules of their own: they are built from their source
// with GOWORK=off into the user's cache and run as subprocesses, whose one
// JSON line gives the figures. Their code is never copied here.

// modulePath is the project's module, which marks its root.
const modulePath = "github.com/idemq/idemq"

// findDir resolves a module directory: as given when it holds a go.mod
// (relative to the working directory), else relative to the project's root
// (the nearest parent of the working directory whose go.mod is idemq's).
// It returns the directory found, or the paths it tried.
func findDir(dir string) (string, []string) {
	tried := []string{dir}
	if hasGoMod(dir) {
		return dir, nil
	}
	if filepath.IsAbs(dir) {
		return "", tried
	}
	if root := projectRoot(); root != "" {
		d := filepath.Clean(filepath.Join(root, dir))
		if hasGoMod(d) {
			return d, nil
		}
		tried = append(tried, d)
	}
	return "", tried
}

func hasGoMod(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, "go.mod"))
	return err == nil
}

// projectRoot is the nearest parent of the working directory holding the
// project's go.mod, or "".
func projectRoot() string {
	wd, err := os.Getwd()
	if err != nil {
		return ""
	}
	for d := wd; ; d = filepath.Dir(d) {
		if b, err := os.ReadFile(filepath.Join(d, "go.mod")); err == nil {
			if bytes.HasPrefix(bytes.TrimSpace(b), []byte("module "+modulePath+"\n")) ||
				bytes.Contains(b, []byte("\nmodule "+modulePath+"\n")) {
				return d
			}
		}
		if filepath.Dir(d) == d {
			return ""
		}
	}
}

// binDir is where the built reference consumers and peers go.
func binDir() string {
	cache, err := os.UserCacheDir()
	if err != nil {
		cache = os.TempDir()
	}
	return filepath.Join(cache, "idemq")
}

// goBuild runs `go build -o out pkgs...` in dir with GOWORK=off.
func goBuild(ctx context.Context, dir, out string, pkgs ...string) error {
	args := append([]string{"build", "-o", out}, pkgs...)
	build := exec.CommandContext(ctx, "go", args...)
	build.Dir = dir
	build.Env = append(os.Environ(), "GOWORK=off")
	if b, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("go build in %s: %w: %s", dir, err, bytes.TrimSpace(b))
	}
	return nil
}

// buildBenchref builds e2e and rmqbench from the benchref module; it
// returns why the reference rows cannot run, or "".
func (b *bench) buildBenchref(ctx context.Context, out io.Writer) string {
	if b.o.BenchrefDir == "" {
		return "not run: --benchref is empty"
	}
	dir, tried := findDir(b.o.BenchrefDir)
	if dir == "" {
		return fmt.Sprintf("not run: no benchref module at %s (--benchref DIR)", strings.Join(tried, " or "))
	}
	bin := filepath.Join(binDir(), "benchref")
	fmt.Fprintf(out, "building the reference consumers from %s …\n", dir)
	if err := goBuild(ctx, dir, bin+string(filepath.Separator), "./cmd/..."); err != nil {
		return "not run: " + err.Error()
	}
	b.benchrefBin = bin
	return ""
}

// buildPeer builds the module at dir (bench/watermill, bench/river) into
// the binary name; it returns why its rows cannot run, or "".
func (b *bench) buildPeer(ctx context.Context, out io.Writer, dir, name, what string, bin *string) string {
	if dir == "" {
		return ""
	}
	found, tried := findDir(dir)
	if found == "" {
		return fmt.Sprintf("not run: no module at %s (run from the repository, or give its directory)", strings.Join(tried, " or "))
	}
	fmt.Fprintf(out, "building the %s from %s …\n", what, found)
	path := filepath.Join(binDir(), name)
	if err := goBuild(ctx, found, path, "."); err != nil {
		return "not run: " + err.Error()
	}
	*bin = path
	return ""
}

// runPeer runs a built program and returns its last stdout line and its
// resource usage.
func runPeer(ctx context.Context, limit time.Duration, env []string, name string, args ...string) ([]byte, *syscall.Rusage, error) {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = append(os.Environ(), env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	usage, err := runMeasured(cmd)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w: %s", filepath.Base(name), err, redact.String(lastLines(stderr.String(), 5)))
	}
	return lastLine(stdout.Bytes()), usage, nil
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// peerLimit bounds a peer's run: it stops only when it has its count.
func (b *bench) peerLimit() time.Duration { return max(4*b.o.MaxDuration, 5*time.Minute) }

// runBenchref runs benchref's e2e on the preloaded queue: pipelined batches
// of 100 (5ms linger, 2 flushers, one connection each), the same prefetch.
// Its tables live in a schema of their own (its search_path).
func (b *bench) runBenchref(ctx context.Context, queue, work string) (workerResult, *syscall.Rusage, error) {
	s := pgx.Identifier{refSchema}.Sanitize()
	if _, err := b.pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+s+" CASCADE; CREATE SCHEMA "+s); err != nil {
		return workerResult{}, nil, err
	}
	pgURL, err := withSearchPath(b.o.PostgresURL, refSchema)
	if err != nil {
		return workerResult{}, nil, err
	}
	line, usage, err := runPeer(ctx, b.peerLimit(), []string{"PG_URL=" + pgURL, "AMQP_URL=" + b.o.AMQPURL},
		filepath.Join(b.benchrefBin, "e2e"), "-queue", queue, "-type", "quorum", "-n", strconv.Itoa(b.o.Messages),
		"-prefetch", strconv.Itoa(b.o.Prefetch), "-mode", "pbatch", "-batch", "100", "-linger", "5ms", "-flushers", "2", "-work", work)
	if err != nil {
		return workerResult{}, nil, err
	}
	var e2e struct {
		N     int     `json:"n"`
		Secs  float64 `json:"secs"`
		Extra struct {
			Remaining    int `json:"remaining"`
			HandlerCalls int `json:"handler_calls"`
		} `json:"extra"`
	}
	if err := json.Unmarshal(line, &e2e); err != nil {
		return workerResult{}, nil, fmt.Errorf("e2e output %q: %w", line, err)
	}
	res := workerResult{Settled: e2e.N, FirstToLast: int64(e2e.Secs * 1e9)}
	if e2e.Extra.Remaining != 0 {
		res.Note = fmt.Sprintf("%d messages left in the queue", e2e.Extra.Remaining)
	}
	return res, usage, nil
}

// withSearchPath adds a search_path run-time parameter to a Postgres URL or
// key=value DSN (pgx passes unknown parameters to the server).
func withSearchPath(pg, schema string) (string, error) {
	if u, err := url.Parse(pg); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		q := u.Query()
		q.Set("search_path", schema)
		u.RawQuery = q.Encode()
		return u.String(), nil
	}
	if strings.Contains(pg, "=") {
		return pg + " search_path=" + schema, nil
	}
	return "", fmt.Errorf("cannot add a search_path to %s", redact.URL(pg))
}

// runWatermill runs the Watermill peer on the preloaded queue: as many
// consumers as idemq has handlers, the prefetch shared among them (the same
// number of messages in flight), the Deduplicator's repository in memory or
// in Postgres (then the handler also writes the ledger row).
func (b *bench) runWatermill(ctx context.Context, queue, dedupKind string) (workerResult, *syscall.Rusage, error) {
	args := []string{"--amqp-url", b.o.AMQPURL, "--queue", queue, "--count", strconv.Itoa(b.o.Messages),
		"--concurrency", strconv.Itoa(b.o.Concurrency), "--prefetch", strconv.Itoa(max(1, b.o.Prefetch/b.o.Concurrency)),
		"--dedup", dedupKind, "--max-duration", b.peerLimit().String()}
	if dedupKind == "postgres" {
		args = append(args, "--effect", "ledger", "--postgres-url", b.o.PostgresURL, "--schema", benchSchema)
	}
	line, usage, err := runPeer(ctx, b.peerLimit()+time.Minute, nil, b.watermillBin, args...)
	if err != nil {
		return workerResult{}, nil, err
	}
	var wm struct {
		Handled      int   `json:"handled"`
		Deduplicated int   `json:"deduplicated"`
		FirstToLast  int64 `json:"first_to_last_ns"`
	}
	if err := json.Unmarshal(line, &wm); err != nil {
		return workerResult{}, nil, fmt.Errorf("watermill output %q: %w", line, err)
	}
	return workerResult{Settled: wm.Handled + wm.Deduplicated, FirstToLast: wm.FirstToLast}, usage, nil
}

// riverInsert makes River's schema and inserts the jobs (not measured).
func (b *bench) riverInsert(ctx context.Context) error {
	_, _, err := runPeer(ctx, b.peerLimit(), nil, b.riverBin, "insert", "--postgres-url", b.o.PostgresURL,
		"--schema", riverSchema, "--count", strconv.Itoa(b.o.Messages))
	return err
}

// runRiver drains the inserted jobs with River's workers.
func (b *bench) runRiver(ctx context.Context) (workerResult, *syscall.Rusage, error) {
	line, usage, err := runPeer(ctx, b.peerLimit()+time.Minute, nil, b.riverBin, "work", "--postgres-url", b.o.PostgresURL,
		"--schema", riverSchema, "--count", strconv.Itoa(b.o.Messages), "--workers", strconv.Itoa(b.o.RiverWorkers),
		"--max-duration", b.peerLimit().String())
	if err != nil {
		return workerResult{}, nil, err
	}
	var rv struct {
		Completed   int   `json:"completed"`
		FirstToLast int64 `json:"first_to_last_ns"`
	}
	if err := json.Unmarshal(line, &rv); err != nil {
		return workerResult{}, nil, fmt.Errorf("river output %q: %w", line, err)
	}
	return workerResult{Settled: rv.Completed, FirstToLast: rv.FirstToLast}, usage, nil
}
