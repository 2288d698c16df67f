package chaos

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

// The soak breaks its services on purpose: it restarts Postgres, stops the
// broker's application and closes every broker connection. On a machine
// where other tests share those services (go test ./... runs packages in
// parallel) that would break them too, so by default the soak runs a
// Postgres cluster and a RabbitMQ node of its own ("private" services),
// created on first use and left running for the next run:
//
//   - Postgres: cluster "<version> idemqchaos" on 127.0.0.1:5442
//     (pg_createcluster / pg_ctlcluster, trust authentication);
//   - RabbitMQ: node idemq-chaos@localhost on 127.0.0.1:5682, with its data
//     under /var/lib/rabbitmq/idemq-chaos (rabbitmq-server -detached).
//
// IDEMQ_CHAOS_SERVICES=shared turns the faults on the services of the other
// tests instead (IDEMQ_TEST_POSTGRES_URL / IDEMQ_TEST_AMQP_URL, cluster
// IDEMQ_CHAOS_PG_CLUSTER, default "15 main", node IDEMQ_CHAOS_RABBIT_NODE,
// default rabbitmqctl's own), for a machine that runs nothing else.
const (
	privatePGName     = "idemqchaos"
	privatePGPort     = 5442
	privateRabbitNode = "idemq-chaos@localhost"
	privateAMQPPort   = 5682
	privateDistPort   = 25682
	privateRabbitBase = "/var/lib/rabbitmq/idemq-chaos"
)

// services are the Postgres cluster and RabbitMQ node the soak runs on and
// breaks.
type services struct {
	mode string
	// pgURL and amqpURL reach the services directly (the workers go through
	// toxiproxy instead).
	pgURL, amqpURL string
	pgHostPort     string
	amqpHostPort   string
	// pgVersion and pgCluster name the cluster for pg_ctlcluster.
	pgVersion, pgCluster string
	// rabbitNode is passed to rabbitmqctl -n ("" = its default node).
	rabbitNode string
	rabbitEnv  []string
}

// newServices returns the services of IDEMQ_CHAOS_SERVICES (private by
// default), started and answering. It registers a cleanup that restores
// them, whatever the test did to them.
func newServices(t *testing.T) *services {
	t.Helper()
	s := &services{mode: envOr("IDEMQ_CHAOS_SERVICES", "private")}
	switch s.mode {
	case "private":
		s.pgVersion = envOr("IDEMQ_CHAOS_PG_VERSION", "15")
		s.pgCluster = privatePGName
		s.pgHostPort = fmt.Sprintf("127.0.0.1:%d", privatePGPort)
		s.pgURL = fmt.Sprintf("postgres://postgres@%s/postgres?sslmode=disable", s.pgHostPort)
		s.rabbitNode = privateRabbitNode
		s.amqpHostPort = fmt.Sprintf("127.0.0.1:%d", privateAMQPPort)
		s.amqpURL = fmt.Sprintf("amqp://guest:guest@%s/", s.amqpHostPort)
		s.rabbitEnv = []string{
			"RABBITMQ_NODENAME=" + privateRabbitNode,
			"RABBITMQ_NODE_PORT=" + strconv.Itoa(privateAMQPPort),
			"RABBITMQ_DIST_PORT=" + strconv.Itoa(privateDistPort),
			"RABBITMQ_CONFIG_FILE=" + filepath.Join(privateRabbitBase, "rabbitmq.conf"),
			"RABBITMQ_CONF_ENV_FILE=" + filepath.Join(privateRabbitBase, "rabbitmq-env.conf"),
			"RABBITMQ_ENABLED_PLUGINS_FILE=" + filepath.Join(privateRabbitBase, "enabled_plugins"),
			"RABBITMQ_MNESIA_BASE=" + filepath.Join(privateRabbitBase, "mnesia"),
			"RABBITMQ_LOG_BASE=" + filepath.Join(privateRabbitBase, "log"),
			"RABBITMQ_PID_FILE=" + filepath.Join(privateRabbitBase, "pid"),
			"ERL_EPMD_ADDRESS=127.0.0.1",
		}
	case "shared":
		cluster := strings.Fields(envOr("IDEMQ_CHAOS_PG_CLUSTER", "15 main"))
		if len(cluster) != 2 {
			t.Fatalf("IDEMQ_CHAOS_PG_CLUSTER=%q: want \"<version> <name>\" as pg_lsclusters shows it", os.Getenv("IDEMQ_CHAOS_PG_CLUSTER"))
		}
		s.pgVersion, s.pgCluster = cluster[0], cluster[1]
		s.rabbitNode = os.Getenv("IDEMQ_CHAOS_RABBIT_NODE")
		s.pgURL, s.amqpURL = testdb.URL(), testamqp.URL()
		var err error
		if s.pgHostPort, err = hostPort(s.pgURL, "5432"); err != nil {
			t.Fatalf("IDEMQ_TEST_POSTGRES_URL: %v", err)
		}
		if s.amqpHostPort, err = hostPort(s.amqpURL, "5672"); err != nil {
			t.Fatalf("IDEMQ_TEST_AMQP_URL: %v", err)
		}
	default:
		t.Fatalf("IDEMQ_CHAOS_SERVICES=%q: want private or shared", s.mode)
	}
	// One soak at a time on the same services: two would break each other's
	// runs (go test ./... of two checkouts, or make test next to make chaos).
	lockServices(t, s.mode+"-"+strings.ReplaceAll(s.pgHostPort+"-"+s.amqpHostPort, ":", "_"))
	// Restore first: an earlier run killed in the middle of a fault may
	// have left a service down.
	t.Cleanup(func() {
		if err := s.restore(); err != nil {
			t.Errorf("chaos: RESTORE FAILED, a service may be left down: %v", err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	if err := s.up(ctx); err != nil {
		t.Fatalf("chaos: %s services are not usable: %v", s.mode, err)
	}
	return s
}

// up creates the private services if needed and starts whatever is down,
// then waits until both answer.
func (s *services) up(ctx context.Context) error {
	if s.mode == "private" {
		if err := s.createPrivatePG(ctx); err != nil {
			return err
		}
		if err := s.preparePrivateRabbit(); err != nil {
			return err
		}
	}
	if err := s.pgStart(ctx); err != nil {
		return err
	}
	return s.brokerStart(ctx)
}

// restore brings back whatever a fault left down. It runs in cleanups,
// after failures too.
func (s *services) restore() error {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	return errors.Join(s.pgStart(ctx), s.brokerStart(ctx))
}

func (s *services) createPrivatePG(ctx context.Context) error {
	out, err := run(ctx, nil, "pg_lsclusters", "-h")
	if err != nil {
		return fmt.Errorf("pg_lsclusters (are the Debian postgresql-common tools installed?): %w", err)
	}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && f[0] == s.pgVersion && f[1] == s.pgCluster {
			return nil
		}
	}
	_, err = run(ctx, nil, "pg_createcluster", s.pgVersion, s.pgCluster, "-p", strconv.Itoa(privatePGPort),
		"--", "--auth=trust")
	if err != nil {
		return fmt.Errorf("create the soak's Postgres cluster: %w", err)
	}
	return nil
}

// preparePrivateRabbit writes the private node's configuration: its own
// port, data and logs, nothing read from /etc/rabbitmq.
func (s *services) preparePrivateRabbit() error {
	files := map[string]string{
		"rabbitmq.conf":     fmt.Sprintf("listeners.tcp.local = 127.0.0.1:%d\n", privateAMQPPort),
		"rabbitmq-env.conf": "ERL_EPMD_ADDRESS=127.0.0.1\nexport ERL_FLAGS=\"-kernel inet_dist_use_interface {127,0,0,1}\"\n",
		"enabled_plugins":   "[].\n",
	}
	for _, dir := range []string{privateRabbitBase, filepath.Join(privateRabbitBase, "mnesia"), filepath.Join(privateRabbitBase, "log")} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("prepare the soak's RabbitMQ node: %w", err)
		}
	}
	for name, content := range files {
		path := filepath.Join(privateRabbitBase, name)
		if old, err := os.ReadFile(path); err == nil && string(old) == content {
			continue
		}
		if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
			return fmt.Errorf("prepare the soak's RabbitMQ node: %w", err)
		}
	}
	// The server runs as the rabbitmq user (the Debian wrapper switches to it).
	if _, err := run(context.Background(), nil, "chown", "-R", "rabbitmq:rabbitmq", privateRabbitBase); err != nil {
		return fmt.Errorf("prepare the soak's RabbitMQ node: %w", err)
	}
	return nil
}

// ---------------------------------------------------------------- Postgres

func (s *services) pgctl(ctx context.Context, args ...string) error {
	full := append([]string{"--skip-systemctl-redirect", s.pgVersion, s.pgCluster}, args...)
	_, err := run(ctx, nil, "pg_ctlcluster", full...)
	return err
}

// pgStart starts the cluster unless it runs, and waits until it answers.
func (s *services) pgStart(ctx context.Context) error {
	if s.pgAnswers(ctx) {
		return nil
	}
	if err := s.pgctl(ctx, "start"); err != nil && !s.pgAnswers(ctx) {
		// "already running" is an error for pg_ctlcluster; an answer settles it.
		return fmt.Errorf("start Postgres %s/%s: %w", s.pgVersion, s.pgCluster, err)
	}
	if err := waitUntil(ctx, 2*time.Minute, func() bool { return s.pgAnswers(ctx) }); err != nil {
		return fmt.Errorf("Postgres %s/%s does not answer after start: %w", s.pgVersion, s.pgCluster, err)
	}
	return nil
}

func (s *services) pgAnswers(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.pgURL)
	if err != nil {
		return false
	}
	defer conn.Close(context.Background())
	return conn.Ping(ctx) == nil
}

func (s *services) pgRestartFast(ctx context.Context) error {
	if err := s.pgctl(ctx, "restart", "-m", "fast"); err != nil {
		return fmt.Errorf("restart Postgres: %w", err)
	}
	return s.pgStart(ctx)
}

func (s *services) pgStopImmediate(ctx context.Context) error {
	if err := s.pgctl(ctx, "stop", "-m", "immediate"); err != nil {
		return fmt.Errorf("stop Postgres: %w", err)
	}
	return nil
}

// pgTerminate ends every backend whose application_name starts with prefix
// and returns how many it ended.
func (s *services) pgTerminate(ctx context.Context, prefix string) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.pgURL)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.Background())
	var n int
	err = conn.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
FROM pg_stat_activity WHERE starts_with(application_name, $1) AND pid <> pg_backend_pid()`, prefix).Scan(&n)
	return n, err
}

// ---------------------------------------------------------------- RabbitMQ

func (s *services) rabbitmqctl(ctx context.Context, args ...string) (string, error) {
	if s.rabbitNode != "" {
		args = append([]string{"-n", s.rabbitNode}, args...)
	}
	return run(ctx, nil, "rabbitmqctl", args...)
}

// brokerStart starts the node (private mode) or its application unless
// they run, and waits until the broker takes AMQP connections.
func (s *services) brokerStart(ctx context.Context) error {
	if s.amqpAnswers() {
		return nil
	}
	if s.mode == "private" {
		if _, err := s.rabbitmqctl(ctx, "ping", "--timeout", "5"); err != nil {
			if _, err := run(ctx, s.rabbitEnv, "rabbitmq-server", "-detached"); err != nil {
				return fmt.Errorf("start the soak's RabbitMQ node: %w", err)
			}
			// The node registers with epmd a few seconds after -detached returns.
			if err := waitUntil(ctx, 2*time.Minute, func() bool {
				_, err := s.rabbitmqctl(ctx, "ping", "--timeout", "5")
				return err == nil
			}); err != nil {
				return fmt.Errorf("the soak's RabbitMQ node does not come up: %w", err)
			}
		}
	}
	if _, err := s.rabbitmqctl(ctx, "start_app"); err != nil {
		return fmt.Errorf("rabbitmqctl start_app: %w", err)
	}
	if _, err := s.rabbitmqctl(ctx, "await_startup", "--timeout", "120"); err != nil {
		return fmt.Errorf("rabbitmqctl await_startup: %w", err)
	}
	if err := waitUntil(ctx, 2*time.Minute, s.amqpAnswers); err != nil {
		return fmt.Errorf("RabbitMQ does not take connections after start: %w", err)
	}
	return nil
}

func (s *services) amqpAnswers() bool {
	conn, err := amqp.DialConfig(s.amqpURL, amqp.Config{Dial: amqp.DefaultDial(3 * time.Second), Properties: connName("idemq-chaos-probe")})
	if err != nil {
		return false
	}
	_ = conn.Close()
	return true
}

func (s *services) brokerStopApp(ctx context.Context) error {
	if _, err := s.rabbitmqctl(ctx, "stop_app"); err != nil {
		return fmt.Errorf("rabbitmqctl stop_app: %w", err)
	}
	return nil
}

func (s *services) brokerCloseAll(ctx context.Context) error {
	_, err := s.rabbitmqctl(ctx, "close_all_connections", "closed by the idemq chaos soak")
	return err
}

// ---------------------------------------------------------------- helpers

// run runs a command with a bound on its time and returns its output; the
// error carries the output.
func run(ctx context.Context, env []string, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	if env != nil {
		cmd.Env = append(os.Environ(), env...)
	}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.WaitDelay = 5 * time.Second
	err := cmd.Run()
	if err != nil {
		return out.String(), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(lastLines(out.String(), 5)))
	}
	return out.String(), nil
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// waitUntil polls cond every 250ms until it holds, ctx ends or timeout passes.
func waitUntil(ctx context.Context, timeout time.Duration, cond func() bool) error {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("not within %s", timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
	return nil
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func connName(name string) amqp.Table {
	props := amqp.NewConnectionProperties()
	props.SetClientConnectionName(name)
	return props
}

// lockServices takes an exclusive lock (flock) named after the services,
// held until the test ends, waiting for another soak to finish if needed.
func lockServices(t *testing.T, name string) {
	t.Helper()
	path := filepath.Join(os.TempDir(), "idemq-chaos-"+name+".lock")
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o666)
	if err != nil {
		t.Fatalf("chaos: lock file: %v", err)
	}
	wait := 15 * time.Minute
	if d, ok := t.Deadline(); ok {
		wait = min(wait, time.Until(d)/2)
	}
	deadline := time.Now().Add(wait)
	logged := false
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			break
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			t.Fatalf("chaos: lock %s: %v", path, err)
		}
		if time.Now().After(deadline) {
			owner, _ := os.ReadFile(path)
			t.Fatalf("chaos: another soak (%s) has held %s for %s; not waiting longer", strings.TrimSpace(string(owner)), path, wait)
		}
		if !logged {
			owner, _ := os.ReadFile(path)
			t.Logf("chaos: waiting for another soak (%s) to finish with the services", strings.TrimSpace(string(owner)))
			logged = true
		}
		// Polling a lock: nothing to wait on but time.
		time.Sleep(time.Second)
	}
	_ = f.Truncate(0)
	_, _ = f.WriteAt([]byte(fmt.Sprintf("pid %d, %s", os.Getpid(), t.Name())), 0)
	t.Cleanup(func() {
		_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		_ = f.Close()
	})
}
