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
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/internal/amqpdial"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

// The soak breaks its services on purpose: it restarts Postgres, stops the
// broker's application and closes every broker connection. On a machine
// where other tests share those services (go test ./... runs packages in
// parallel) that would break them too, so by default the soak runs a
// Postgres cluster and a RabbitMQ node of its own ("private" services),
// created on first use (and kept for the next run), started when down and
// stopped again when the test process ends (stopPrivateServices), so that a
// run leaves the machine as it found it: one that was running before the
// run is left running.
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
// breaks (or, in cluster mode, a three-node RabbitMQ cluster and three
// Postgres members under Patroni: see cluster_test.go).
type services struct {
	mode string
	// pgURL and amqpURL reach the services directly (the workers go through
	// toxiproxy instead). In cluster mode pgURL names the three Postgres servers
	// (target_session_attrs=read-write) and amqpURL the first node.
	pgURL, amqpURL string
	// amqpURLs are the broker addresses a client may dial, in order.
	amqpURLs     []string
	pgHostPort   string
	amqpHostPort string
	// pg is the Postgres cluster the faults hit, rabbit the RabbitMQ node
	// (single-node modes).
	pg     *pgCluster
	rabbit *rabbitNode
	// cluster is the topology of cluster mode (nil otherwise).
	cluster *cluster
}

// newServices returns the services of IDEMQ_CHAOS_SERVICES (private by
// default), started and answering. It registers a cleanup that restores
// them, whatever the test did to them.
func newServices(t *testing.T) *services {
	t.Helper()
	s := &services{mode: envOr("IDEMQ_CHAOS_SERVICES", "private")}
	switch s.mode {
	case "private":
		s.pg = &pgCluster{version: envOr("IDEMQ_CHAOS_PG_VERSION", "15"), name: privatePGName, port: privatePGPort}
		s.pg.url = s.pg.localURL()
		s.rabbit = newPrivateNode(privateRabbitNode, privateAMQPPort, privateDistPort, privateRabbitBase)
		privateFound.note(s.pg, s.rabbit)
	case "shared":
		cluster := strings.Fields(envOr("IDEMQ_CHAOS_PG_CLUSTER", "15 main"))
		if len(cluster) != 2 {
			t.Fatalf("IDEMQ_CHAOS_PG_CLUSTER=%q: want \"<version> <name>\" as pg_lsclusters shows it", os.Getenv("IDEMQ_CHAOS_PG_CLUSTER"))
		}
		s.pg = &pgCluster{version: cluster[0], name: cluster[1], url: testdb.URL()}
		s.rabbit = &rabbitNode{name: os.Getenv("IDEMQ_CHAOS_RABBIT_NODE"), url: testamqp.URL()}
	default:
		t.Fatalf("IDEMQ_CHAOS_SERVICES=%q: want private or shared", s.mode)
	}
	s.pgURL, s.amqpURL, s.amqpURLs = s.pg.url, s.rabbit.url, []string{s.rabbit.url}
	var err error
	if s.pgHostPort, err = hostPort(s.pgURL, "5432"); err != nil {
		t.Fatalf("Postgres URL: %v", err)
	}
	if s.amqpHostPort, err = hostPort(s.amqpURL, "5672"); err != nil {
		t.Fatalf("AMQP URL: %v", err)
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

// downAtStart are the private services a test process found down at its
// first use of them: the ones it started, and stops when it ends.
type downAtStart struct {
	sync.Mutex
	noted  bool
	pg     *pgCluster  // nil when it answered
	rabbit *rabbitNode // nil when it answered
}

var privateFound downAtStart

// note records, the first time only, which of pg and rabbit are down.
func (f *downAtStart) note(pg *pgCluster, rabbit *rabbitNode) {
	f.Lock()
	defer f.Unlock()
	if f.noted {
		return
	}
	f.noted = true
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if !pg.answers(ctx) {
		f.pg = pg
	}
	if !rabbit.amqpAnswers() {
		f.rabbit = rabbit
	}
}

// stopPrivateServices stops the private services this test process found
// down and started (TestMain calls it after the tests).
func stopPrivateServices() error {
	privateFound.Lock()
	defer privateFound.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var errs []error
	if n := privateFound.rabbit; n != nil && n.running(ctx) {
		errs = append(errs, n.stop(ctx))
	}
	if p := privateFound.pg; p != nil && p.answers(ctx) {
		if err := p.ctl(ctx, "stop", "-m", "fast"); err != nil {
			errs = append(errs, fmt.Errorf("stop Postgres %s: %w", p, err))
		}
	}
	return errors.Join(errs...)
}

// up creates the private services if needed and starts whatever is down,
// then waits until both answer.
func (s *services) up(ctx context.Context) error {
	if s.mode == "private" {
		if err := s.pg.create(ctx, "--auth=trust"); err != nil {
			return fmt.Errorf("create the soak's Postgres cluster: %w", err)
		}
		if err := s.rabbit.prepare(); err != nil {
			return fmt.Errorf("prepare the soak's RabbitMQ node: %w", err)
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

// amqpAddrs are the broker addresses, parsed.
func (s *services) amqpAddrs(t *testing.T) amqpdial.Addrs {
	t.Helper()
	addrs, err := amqpdial.Parse(s.amqpURLs...)
	if err != nil {
		t.Fatalf("broker addresses: %v", err)
	}
	return addrs
}

// The faults of the single-node modes, on s.pg and s.rabbit.

func (s *services) pgStart(ctx context.Context) error     { return s.pg.start(ctx) }
func (s *services) brokerStart(ctx context.Context) error { return s.rabbit.start(ctx) }

func (s *services) rabbitmqctl(ctx context.Context, args ...string) (string, error) {
	return s.rabbit.ctl(ctx, args...)
}

func (s *services) pgRestartFast(ctx context.Context) error {
	if err := s.pg.ctl(ctx, "restart", "-m", "fast"); err != nil {
		return fmt.Errorf("restart Postgres: %w", err)
	}
	return s.pgStart(ctx)
}

func (s *services) pgStopImmediate(ctx context.Context) error {
	if err := s.pg.ctl(ctx, "stop", "-m", "immediate"); err != nil {
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

func (s *services) brokerStopApp(ctx context.Context) error {
	if _, err := s.rabbit.ctl(ctx, "stop_app"); err != nil {
		return fmt.Errorf("rabbitmqctl stop_app: %w", err)
	}
	return nil
}

// brokerRestart restarts the whole node: stop, wait for the VM to go,
// start. Only a private node can be started again.
func (s *services) brokerRestart(ctx context.Context) error {
	if s.rabbit.base == "" {
		return errors.New("the broker is not the soak's own node: it cannot be restarted")
	}
	if err := s.rabbit.stop(ctx); err != nil {
		return err
	}
	return s.brokerStart(ctx)
}

func (s *services) brokerCloseAll(ctx context.Context) error {
	_, err := s.rabbit.ctl(ctx, "close_all_connections", "closed by the idemq chaos soak")
	return err
}

// ---------------------------------------------------------------- Postgres

// pgCluster is one Postgres cluster as pg_lsclusters names it.
type pgCluster struct {
	version, name string
	// port is the cluster's port (0 for a cluster the soak does not create).
	port int
	url  string
}

// localURL is the URL of a cluster the soak runs itself: 127.0.0.1, trust.
func (p *pgCluster) localURL() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", p.port)
}

func (p *pgCluster) String() string { return p.version + "/" + p.name }

func (p *pgCluster) ctl(ctx context.Context, args ...string) error {
	full := append([]string{"--skip-systemctl-redirect", p.version, p.name}, args...)
	_, err := run(ctx, nil, "pg_ctlcluster", full...)
	return err
}

// exists reports whether pg_lsclusters lists the cluster.
func (p *pgCluster) exists(ctx context.Context) (bool, error) {
	out, err := run(ctx, nil, "pg_lsclusters", "-h")
	if err != nil {
		return false, fmt.Errorf("pg_lsclusters (are the Debian postgresql-common tools installed?): %w", err)
	}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && f[0] == p.version && f[1] == p.name {
			return true, nil
		}
	}
	return false, nil
}

// create makes the cluster on its port unless it exists, passing initdb
// the given options.
func (p *pgCluster) create(ctx context.Context, initdb ...string) error {
	if ok, err := p.exists(ctx); err != nil || ok {
		return err
	}
	args := append([]string{p.version, p.name, "-p", strconv.Itoa(p.port), "--"}, initdb...)
	_, err := run(ctx, nil, "pg_createcluster", args...)
	return err
}

// start starts the cluster unless it runs, and waits until it answers.
func (p *pgCluster) start(ctx context.Context) error {
	if p.answers(ctx) {
		return nil
	}
	if err := p.ctl(ctx, "start"); err != nil && !p.answers(ctx) {
		// "already running" is an error for pg_ctlcluster; an answer settles it.
		return fmt.Errorf("start Postgres %s: %w", p, err)
	}
	if err := waitUntil(ctx, 2*time.Minute, func() bool { return p.answers(ctx) }); err != nil {
		return fmt.Errorf("Postgres %s does not answer after start: %w", p, err)
	}
	return nil
}

func (p *pgCluster) answers(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, p.url)
	if err != nil {
		return false
	}
	defer conn.Close(context.Background())
	return conn.Ping(ctx) == nil
}

// ---------------------------------------------------------------- RabbitMQ

// rabbitNode is one RabbitMQ node: one the soak runs itself (base set:
// its own ports, data and logs, nothing read from /etc/rabbitmq), or one it
// only drives with rabbitmqctl.
type rabbitNode struct {
	// name is passed to rabbitmqctl -n ("" = its default node).
	name               string
	amqpPort, distPort int
	// base is the data directory of a node the soak runs ("" otherwise).
	base string
	url  string
}

func newPrivateNode(name string, amqpPort, distPort int, base string) *rabbitNode {
	return &rabbitNode{name: name, amqpPort: amqpPort, distPort: distPort, base: base,
		url: fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", amqpPort)}
}

// env is the environment rabbitmq-server runs a private node with.
func (n *rabbitNode) env() []string {
	return []string{
		"RABBITMQ_NODENAME=" + n.name,
		"RABBITMQ_NODE_PORT=" + strconv.Itoa(n.amqpPort),
		"RABBITMQ_DIST_PORT=" + strconv.Itoa(n.distPort),
		"RABBITMQ_CONFIG_FILE=" + filepath.Join(n.base, "rabbitmq.conf"),
		"RABBITMQ_CONF_ENV_FILE=" + filepath.Join(n.base, "rabbitmq-env.conf"),
		"RABBITMQ_ENABLED_PLUGINS_FILE=" + filepath.Join(n.base, "enabled_plugins"),
		"RABBITMQ_MNESIA_BASE=" + filepath.Join(n.base, "mnesia"),
		"RABBITMQ_LOG_BASE=" + filepath.Join(n.base, "log"),
		"RABBITMQ_PID_FILE=" + filepath.Join(n.base, "pid"),
		"ERL_EPMD_ADDRESS=127.0.0.1",
	}
}

// prepare writes a private node's configuration: its own port, data and
// logs, and one plugin, the consistent-hash exchange of partitioned queues
// (it listens on nothing; the management plugin's listener would clash
// with another node's).
func (n *rabbitNode) prepare() error {
	files := map[string]string{
		"rabbitmq.conf":     fmt.Sprintf("listeners.tcp.local = 127.0.0.1:%d\n", n.amqpPort),
		"rabbitmq-env.conf": "ERL_EPMD_ADDRESS=127.0.0.1\nexport ERL_FLAGS=\"-kernel inet_dist_use_interface {127,0,0,1}\"\n",
		"enabled_plugins":   "[rabbitmq_consistent_hash_exchange].\n",
	}
	for _, dir := range []string{n.base, filepath.Join(n.base, "mnesia"), filepath.Join(n.base, "log")} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	for name, content := range files {
		path := filepath.Join(n.base, name)
		if old, err := os.ReadFile(path); err == nil && string(old) == content {
			continue
		}
		if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
			return err
		}
	}
	// The server runs as the rabbitmq user (the Debian wrapper switches to it).
	_, err := run(context.Background(), nil, "chown", "-R", "rabbitmq:rabbitmq", n.base)
	return err
}

func (n *rabbitNode) ctl(ctx context.Context, args ...string) (string, error) {
	if n.name != "" {
		args = append([]string{"-n", n.name}, args...)
	}
	return run(ctx, nil, "rabbitmqctl", args...)
}

// running reports whether the node's Erlang VM answers (its application
// may be stopped).
func (n *rabbitNode) running(ctx context.Context) bool {
	_, err := n.ctl(ctx, "ping", "--timeout", "5")
	return err == nil
}

// boot starts a private node's VM unless it runs (rabbitmq-server
// -detached) and waits until it answers rabbitmqctl.
func (n *rabbitNode) boot(ctx context.Context) error {
	if n.running(ctx) {
		return nil
	}
	if _, err := run(ctx, n.env(), "rabbitmq-server", "-detached"); err != nil {
		return fmt.Errorf("start RabbitMQ node %s: %w", n.name, err)
	}
	// The node registers with epmd a few seconds after -detached returns.
	if err := waitUntil(ctx, 2*time.Minute, func() bool { return n.running(ctx) }); err != nil {
		return fmt.Errorf("RabbitMQ node %s does not come up: %w", n.name, err)
	}
	return nil
}

// start starts the node (a private one) or its application unless they
// run, and waits until the broker takes AMQP connections.
func (n *rabbitNode) start(ctx context.Context) error {
	if n.amqpAnswers() {
		return nil
	}
	if n.base != "" {
		if err := n.boot(ctx); err != nil {
			return err
		}
	}
	if _, err := n.ctl(ctx, "start_app"); err != nil {
		return fmt.Errorf("rabbitmqctl start_app: %w", err)
	}
	if _, err := n.ctl(ctx, "await_startup", "--timeout", "120"); err != nil {
		return fmt.Errorf("rabbitmqctl await_startup: %w", err)
	}
	if err := waitUntil(ctx, 2*time.Minute, n.amqpAnswers); err != nil {
		return fmt.Errorf("RabbitMQ does not take connections after start: %w", err)
	}
	return nil
}

// stop stops the whole node (rabbitmqctl stop) and waits until its VM is
// gone, so that a start after it boots a new VM rather than starting the
// application again on one that is still halting.
func (n *rabbitNode) stop(ctx context.Context) error {
	if _, err := n.ctl(ctx, "stop"); err != nil {
		return fmt.Errorf("rabbitmqctl stop: %w", err)
	}
	if err := waitUntil(ctx, 2*time.Minute, func() bool { return !n.running(ctx) }); err != nil {
		return fmt.Errorf("RabbitMQ node %s does not stop: %w", n.name, err)
	}
	return nil
}

func (n *rabbitNode) amqpAnswers() bool {
	addrs, err := amqpdial.Parse(n.url)
	if err != nil {
		return false
	}
	d := amqpdial.Dialer{Addrs: addrs, Name: "idemq-chaos-probe", Timeout: 3 * time.Second}
	conn, err := d.Dial(context.Background())
	if err != nil {
		return false
	}
	_ = conn.Close()
	return true
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
