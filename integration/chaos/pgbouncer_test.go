package chaos

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// The soak through PgBouncer (TestSoakShortThroughPgBouncer) runs a
// PgBouncer of its own in transaction pooling mode in front of the soak's
// Postgres cluster, with the configuration of deploy/local/ensure-pgbouncer.sh
// (auth_user postgres, trust, transaction mode), on a port of its own:
//
//	workers ─ toxiproxy ─ PgBouncer 127.0.0.1:6442 ─ Postgres (5442)
//
// toxiproxy sits in front of PgBouncer, on the link the library itself
// drives: its toxics cut, stall and slow the client connections of pgx,
// which PgBouncer must notice and whose server connections it must roll
// back and give to others. The link behind PgBouncer is broken by the
// Postgres faults instead (pg_terminate_backend of the server connections,
// restart, stop -m immediate), which PgBouncer must survive by opening new
// server connections; a proxy there as well would only add a second way
// of cutting the same server connections.
const (
	privatePgBouncerPort = 6442
	// faultPgBouncerRestart kills PgBouncer (SIGKILL, as a crash) and
	// starts it again: every client connection and every server
	// connection goes at once.
	faultPgBouncerRestart = "pgbouncer_restart"
	// relayDeaf is what a relay logs when its LISTEN connection does not
	// hear NOTIFY (outbox.Relay.listen): through PgBouncer the soak's
	// relays LISTEN on a direct connection, which must hear them.
	relayDeaf = "does not hear NOTIFY"
)

// pgBouncerFaultKinds are the faults of the soak through PgBouncer: every
// kind that touches the way to Postgres (the worker's crash in the middle
// of a transaction, the broker's close_all_connections that sends
// in-progress keys to other workers, the Postgres faults, the network
// toxics on the proxy in front of PgBouncer) and PgBouncer's own restart.
// Broker outages and queue deletions test nothing of the pooler and are
// left to TestSoakShort.
var pgBouncerFaultKinds = []string{
	faultWorkerKill, faultCloseAll, faultPGTerminate, faultPGRestart, faultPGStopImmed,
	faultNetLatency, faultNetBlackhole, faultNetResetPeer, faultPgBouncerRestart,
}

// pgBouncer is a PgBouncer process the soak runs and restarts itself.
type pgBouncer struct {
	bin      string
	ini      string
	logPath  string
	pidPath  string
	port     int
	upstream string // Postgres, host:port
	// cred runs it as the postgres user when the test runs as root
	// (PgBouncer refuses to run as root); nil otherwise.
	cred *syscall.Credential

	mu     sync.Mutex
	cmd    *exec.Cmd
	exited chan struct{}
}

// startPgBouncer writes a PgBouncer configuration in a temporary directory
// of its own, starts PgBouncer on privatePgBouncerPort in front of
// upstream (host:port, trust authentication), waits until it answers and
// stops it when the test ends. Its log goes to logDir.
func startPgBouncer(t *testing.T, upstream, logDir string) *pgBouncer {
	t.Helper()
	bin, err := exec.LookPath("pgbouncer")
	if err != nil {
		bin = "/usr/sbin/pgbouncer"
		if _, serr := os.Stat(bin); serr != nil {
			t.Fatalf("chaos: pgbouncer is not installed (apt-get install pgbouncer): %v", errors.Join(err, serr))
		}
	}
	host, port, err := net.SplitHostPort(upstream)
	if err != nil {
		t.Fatalf("chaos: PgBouncer upstream: %v", err)
	}
	b := &pgBouncer{
		bin: bin, port: privatePgBouncerPort, upstream: upstream,
		logPath: filepath.Join(logDir, "pgbouncer.log"),
		// A fixed path, so that a PgBouncer a killed run left behind is
		// found and stopped by the next run (stopStale).
		pidPath: filepath.Join(os.TempDir(), fmt.Sprintf("idemq-chaos-pgbouncer.%d.pid", privatePgBouncerPort)),
	}
	dir, err := os.MkdirTemp("", "idemq-chaos-pgbouncer-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	b.ini = filepath.Join(dir, "pgbouncer.ini")
	userlist := filepath.Join(dir, "userlist.txt")
	// The shape of deploy/local/ensure-pgbouncer.sh, but for the port, the
	// upstream, smaller pools (the soak's workers open about 30
	// connections) and server_login_retry: while Postgres is down PgBouncer
	// tries again every second, not every 15 (its default), so that the
	// soak measures the workers' recovery rather than PgBouncer's pause.
	ini := fmt.Sprintf(`[databases]
* = host=%s port=%s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
pool_mode = transaction
auth_type = trust
auth_file = %s
auth_user = postgres
max_client_conn = 500
default_pool_size = 30
max_db_connections = 40
server_login_retry = 1
ignore_startup_parameters = extra_float_digits
pidfile = %s
admin_users = postgres
`, host, port, b.port, userlist, b.pidPath)
	if err := os.WriteFile(b.ini, []byte(ini), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(userlist, []byte(`"postgres" ""`+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if os.Geteuid() == 0 {
		uid, gid, err := lookupUser("postgres")
		if err != nil {
			t.Fatalf("chaos: PgBouncer refuses to run as root and there is no postgres user to run it as: %v", err)
		}
		if err := os.Chown(dir, int(uid), int(gid)); err != nil {
			t.Fatal(err)
		}
		b.cred = &syscall.Credential{Uid: uid, Gid: gid}
	}
	// One soak's PgBouncer at a time on the port, whatever services the
	// soaks run on (lockServices serializes soaks on the same services
	// only); holding it, a PgBouncer its pid file names is no live soak's.
	lockServices(t, fmt.Sprintf("pgbouncer-%d", b.port))
	if err := b.stopStale(); err != nil {
		t.Fatalf("chaos: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := b.start(ctx); err != nil {
		t.Fatalf("chaos: %v", err)
	}
	t.Cleanup(func() {
		if err := b.stop(); err != nil {
			t.Errorf("chaos: %v", err)
		}
	})
	return b
}

// addr is where PgBouncer listens, host:port.
func (b *pgBouncer) addr() string { return fmt.Sprintf("127.0.0.1:%d", b.port) }

// url is the URL of the soak's database through PgBouncer, for the checks
// that it answers.
func (b *pgBouncer) url() string {
	return fmt.Sprintf("postgres://postgres@%s/postgres?sslmode=disable&connect_timeout=3", b.addr())
}

// start starts PgBouncer in the foreground, as a child of the test process
// that dies with it (Pdeathsig: also when go test's timeout kills the test
// process before its cleanups), and waits until it answers.
func (b *pgBouncer) start(ctx context.Context) error {
	logFile, err := os.OpenFile(b.logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("PgBouncer log: %w", err)
	}
	defer logFile.Close() // the child holds its own descriptor
	cmd := exec.Command(b.bin, b.ini)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: b.cred, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start PgBouncer: %w", err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	b.mu.Lock()
	b.cmd, b.exited = cmd, exited
	b.mu.Unlock()
	err = waitUntil(ctx, 30*time.Second, func() bool {
		select {
		case <-exited:
			return true
		default:
		}
		return b.answers(ctx)
	})
	select {
	case <-exited:
		return fmt.Errorf("PgBouncer exited at start: %s", strings.TrimSpace(tail(b.logPath, 5)))
	default:
	}
	if err != nil {
		return fmt.Errorf("PgBouncer does not answer on %s: %w (log %s)", b.addr(), err, b.logPath)
	}
	return nil
}

// answers reports whether a query through PgBouncer reaches Postgres.
func (b *pgBouncer) answers(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, b.url())
	if err != nil {
		return false
	}
	defer conn.Close(context.Background())
	return conn.Ping(ctx) == nil
}

// kill ends PgBouncer with SIGKILL and waits until it is gone.
func (b *pgBouncer) kill() error {
	b.mu.Lock()
	cmd, exited := b.cmd, b.exited
	b.mu.Unlock()
	if cmd == nil {
		return nil
	}
	_ = cmd.Process.Kill()
	select {
	case <-exited:
		return nil
	case <-time.After(30 * time.Second):
		return fmt.Errorf("PgBouncer (pid %d) does not exit after SIGKILL", cmd.Process.Pid)
	}
}

// stop shuts PgBouncer down (SIGTERM: its immediate shutdown), killing it
// when it lingers.
func (b *pgBouncer) stop() error {
	b.mu.Lock()
	cmd, exited := b.cmd, b.exited
	b.mu.Unlock()
	if cmd == nil {
		return nil
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
		return nil
	case <-time.After(10 * time.Second):
		if err := b.kill(); err != nil {
			return fmt.Errorf("stop PgBouncer: %w", err)
		}
		return nil
	}
}

// stopStale stops a PgBouncer that an earlier run, killed before its
// cleanups, left on the soak's port: its pid file names it.
func (b *pgBouncer) stopStale() error {
	raw, err := os.ReadFile(b.pidPath)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("PgBouncer pid file: %w", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(raw)))
	if err != nil {
		return nil // not ours to judge; PgBouncer checks it itself
	}
	comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	if err != nil || strings.TrimSpace(string(comm)) != "pgbouncer" {
		return nil // stale: PgBouncer removes it at start
	}
	p, err := os.FindProcess(pid)
	if err != nil {
		return nil
	}
	_ = p.Signal(syscall.SIGTERM)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := waitUntil(ctx, 30*time.Second, func() bool { return p.Signal(syscall.Signal(0)) != nil }); err != nil {
		return fmt.Errorf("a PgBouncer left by an earlier run (pid %d, %s) does not stop: %w", pid, b.pidPath, err)
	}
	return nil
}

// lookupUser returns the uid and gid of a user.
func lookupUser(name string) (uid, gid uint32, err error) {
	u, err := user.Lookup(name)
	if err != nil {
		return 0, 0, err
	}
	id, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return 0, 0, fmt.Errorf("uid of %s: %w", name, err)
	}
	g, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return 0, 0, fmt.Errorf("gid of %s: %w", name, err)
	}
	return uint32(id), uint32(g), nil
}

// withQuery returns raw with the query parameter name set to value.
func withQuery(raw, name, value string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return raw
	}
	q := u.Query()
	q.Set(name, value)
	u.RawQuery = q.Encode()
	return u.String()
}
