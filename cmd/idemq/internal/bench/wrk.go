package bench

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// The load of the HTTP rows comes from wrk, a closed-loop generator: a fixed
// number of connections, each sending its next request when the previous
// one is answered. Its Lua script gives every request a key of its own.

// wrkConnections and wrkThreads are the load of every HTTP row.
const (
	wrkConnections = 32
	wrkThreads     = 2
)

// errNoWrk is why the HTTP rows do not run where wrk is not installed.
var errNoWrk = errors.New("not run: wrk is not installed (Debian: apt-get install -y wrk)")

// findWrk returns the path of wrk, or errNoWrk.
func findWrk() (string, error) {
	p, err := exec.LookPath("wrk")
	if err != nil {
		return "", errNoWrk
	}
	return p, nil
}

// wrkScript is the Lua script of a row. Every request is a POST of the
// body with a new Idempotency-Key: the run's prefix, the thread, a counter.
// With dup, every fifth request of a thread repeats one of the thread's
// earlier keys (the answer: a replay, or 409 while the first is in flight).
// response() counts 409s, other answers that are not 2xx, and replays;
// done() prints them on one line that parseWrk reads.
const wrkScript = `-- idemq bench: a new Idempotency-Key per request.
prefix = %q
dup = %t
body = string.rep("x", %d)
path = %q
id = 0
sent = 0
unique = 0
conflicts = 0
others = 0
replayed = 0
local threads = {}

function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
end

function init(args)
  math.randomseed(1000003 * (id + 1))
end

function request()
  sent = sent + 1
  local key
  if dup and sent %% 5 == 0 and unique > 0 then
    key = prefix .. id .. "-" .. math.random(1, unique)
  else
    unique = unique + 1
    key = prefix .. id .. "-" .. unique
  end
  local headers = {}
  headers["Host"] = wrk.headers["Host"]
  headers["Content-Type"] = "application/json"
  headers["Idempotency-Key"] = key
  return wrk.format("POST", path, headers, body)
end

function response(status, headers, body)
  if status == 409 then
    conflicts = conflicts + 1
  elseif status < 200 or status > 299 then
    others = others + 1
  end
  if headers["Idempotent-Replayed"] == "true" then
    replayed = replayed + 1
  end
end

function done(summary, latency, requests)
  local c, o, r = 0, 0, 0
  for _, t in ipairs(threads) do
    c = c + t:get("conflicts")
    o = o + t:get("others")
    r = r + t:get("replayed")
  end
  io.write(string.format("idemq-bench: conflicts %%d others %%d replayed %%d\n", c, o, r))
end
`

// writeWrkScript writes the script of a row into dir.
func writeWrkScript(dir, prefix string, dup bool, bodySize int, path string) (string, error) {
	f := filepath.Join(dir, "idemq-bench.lua")
	return f, os.WriteFile(f, []byte(fmt.Sprintf(wrkScript, prefix, dup, bodySize, path)), 0o600)
}

// wrkResult is what parseWrk reads from wrk's output.
type wrkResult struct {
	Requests int64         // "N requests in D"
	Elapsed  time.Duration // D
	Rate     float64       // Requests/sec
	P50, P99 time.Duration // --latency's distribution
	// Non2xx is wrk's "Non-2xx or 3xx responses"; SocketErrors the sum
	// of its socket errors (connect, read, write, timeout).
	Non2xx, SocketErrors int64
	// From the script's line: 409s, other answers that are not 2xx, and
	// replays (Idempotent-Replayed: true).
	Conflicts, Others, Replayed int64
}

// parseWrk reads wrk's report (run with --latency and wrkScript).
func parseWrk(out []byte) (wrkResult, error) {
	var r wrkResult
	var haveRate, haveScript bool
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		f := strings.Fields(line)
		switch {
		case strings.HasPrefix(line, "Requests/sec:") && len(f) == 2:
			v, err := strconv.ParseFloat(f[1], 64)
			if err != nil {
				return r, fmt.Errorf("wrk: %q: %w", line, err)
			}
			r.Rate, haveRate = v, true
		case len(f) >= 4 && f[1] == "requests" && f[2] == "in":
			n, err := strconv.ParseInt(f[0], 10, 64)
			if err != nil {
				return r, fmt.Errorf("wrk: %q: %w", line, err)
			}
			d, err := time.ParseDuration(strings.TrimSuffix(f[3], ","))
			if err != nil {
				return r, fmt.Errorf("wrk: %q: %w", line, err)
			}
			r.Requests, r.Elapsed = n, d
		case len(f) == 2 && (f[0] == "50%" || f[0] == "99%"):
			d, err := time.ParseDuration(f[1])
			if err != nil {
				return r, fmt.Errorf("wrk: %q: %w", line, err)
			}
			if f[0] == "50%" {
				r.P50 = d
			} else {
				r.P99 = d
			}
		case strings.HasPrefix(line, "Non-2xx or 3xx responses:") && len(f) == 5:
			n, err := strconv.ParseInt(f[4], 10, 64)
			if err != nil {
				return r, fmt.Errorf("wrk: %q: %w", line, err)
			}
			r.Non2xx = n
		case strings.HasPrefix(line, "Socket errors:"):
			// Socket errors: connect 0, read 0, write 0, timeout 0
			for i := 2; i+1 < len(f); i += 2 {
				n, err := strconv.ParseInt(strings.TrimSuffix(f[i+1], ","), 10, 64)
				if err != nil {
					return r, fmt.Errorf("wrk: %q: %w", line, err)
				}
				r.SocketErrors += n
			}
		case strings.HasPrefix(line, "idemq-bench:"):
			if _, err := fmt.Sscanf(line, "idemq-bench: conflicts %d others %d replayed %d", &r.Conflicts, &r.Others, &r.Replayed); err != nil {
				return r, fmt.Errorf("wrk: %q: %w", line, err)
			}
			haveScript = true
		}
	}
	switch {
	case !haveRate:
		return r, fmt.Errorf("wrk: no requests/sec in its output:\n%s", out)
	case !haveScript:
		return r, fmt.Errorf("wrk: the script's counts are missing from its output:\n%s", out)
	case r.Requests > 0 && (r.P50 == 0 || r.P99 == 0):
		return r, fmt.Errorf("wrk: no latency distribution in its output:\n%s", out)
	}
	return r, nil
}

// runWrk runs wrk against url for d with the row's script and parses its
// report.
func runWrk(ctx context.Context, wrk, url, script string, d time.Duration) (wrkResult, error) {
	secs := max(1, int(d.Round(time.Second)/time.Second))
	cmd := exec.CommandContext(ctx, wrk, "-t", strconv.Itoa(wrkThreads), "-c", strconv.Itoa(wrkConnections),
		"-d", strconv.Itoa(secs)+"s", "--timeout", "10s", "--latency", "-s", script, url)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return wrkResult{}, fmt.Errorf("wrk: %w: %s%s", err, stderr.String(), stdout.String())
	}
	return parseWrk(stdout.Bytes())
}
