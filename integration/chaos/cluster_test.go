package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// The production topology on one machine (make cluster, TestSoakCluster):
//
//   - RabbitMQ: three nodes idemq-c1@localhost … idemq-c3@localhost of the
//     Debian rabbitmq-server, AMQP on 127.0.0.1:5701-5703, distribution on
//     25701-25703, data under /var/lib/rabbitmq/idemq-cN, no plugins, the
//     rabbitmq user's Erlang cookie, joined with rabbitmqctl stop_app,
//     join_cluster idemq-c1@localhost, start_app. Quorum queues declared
//     while the three run get a member on each.
//   - Postgres: cluster "15 idemqpga" on 127.0.0.1:5452, the primary, and
//     "15 idemqpgb" on 5453, a streaming standby made with pg_basebackup -R;
//     the primary has synchronous_standby_names = '*' (the one standby is
//     synchronous) and synchronous_commit = on, in a conf.d file of its own,
//     so that pg_basebackup does not copy it to the standby. Clients name
//     both servers with target_session_attrs=read-write.
//
// Everything is created from nothing at the start of a run (what an earlier,
// killed, run left is torn down first) and torn down at the end: nodes
// stopped, their data removed, the Postgres clusters dropped.
// IDEMQ_CHAOS_KEEP_CLUSTER=1 leaves them running after the run.
const (
	clusterNodes     = 3
	clusterAMQPBase  = 5700 // node i listens on clusterAMQPBase+i
	clusterDistBase  = 25700
	clusterPGVersion = "15"
	clusterPGPrimary = 5452
	clusterPGStandby = 5453
	// syncConfName is the file, in a Postgres cluster's conf.d, that makes
	// it wait for its standby.
	syncConfName = "idemq-sync.conf"
)

// cluster is the topology of cluster mode and the state the faults leave
// it in. Only one goroutine (the fault injector, then the cleanups) uses it.
type cluster struct {
	nodes []*rabbitNode
	// down marks the nodes a fault stopped.
	down map[int]bool
	pg   [2]*pgCluster
	// primary indexes pg: the server that takes writes now.
	primary int
}

func newCluster() *cluster {
	c := &cluster{down: map[int]bool{}}
	for i := 1; i <= clusterNodes; i++ {
		c.nodes = append(c.nodes, newPrivateNode(fmt.Sprintf("idemq-c%d@localhost", i),
			clusterAMQPBase+i, clusterDistBase+i, fmt.Sprintf("/var/lib/rabbitmq/idemq-c%d", i)))
	}
	for i, port := range []int{clusterPGPrimary, clusterPGStandby} {
		p := &pgCluster{version: clusterPGVersion, name: "idemqpg" + string(rune('a'+i)), port: port}
		p.url = p.localURL()
		c.pg[i] = p
	}
	return c
}

// amqpURLs are the three nodes' addresses.
func (c *cluster) amqpURLs() []string {
	var out []string
	for _, n := range c.nodes {
		out = append(out, n.url)
	}
	return out
}

// pgURL names both Postgres servers; pgx connects to the one that takes
// writes.
func (c *cluster) pgURL() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/postgres?sslmode=disable&target_session_attrs=read-write",
		clusterPGPrimary, clusterPGStandby)
}

// newClusterServices creates the cluster topology for t and tears it down
// when t ends.
func newClusterServices(t *testing.T) *services {
	t.Helper()
	c := setUpCluster(t, true)
	return &services{mode: "cluster", cluster: c, pgURL: c.pgURL(), amqpURL: c.nodes[0].url, amqpURLs: c.amqpURLs(),
		pgHostPort: "cluster", amqpHostPort: "cluster"}
}

// setUpCluster creates the Postgres primary and standby, and the RabbitMQ
// nodes when rabbit is set, for t, removing first what an earlier run left,
// and tears them down when t ends.
func setUpCluster(t *testing.T, rabbit bool) *cluster {
	t.Helper()
	c := newCluster()
	lockServices(t, "cluster")
	keep := os.Getenv("IDEMQ_CHAOS_KEEP_CLUSTER") != ""
	t.Cleanup(func() {
		if keep {
			t.Logf("cluster: left running (IDEMQ_CHAOS_KEEP_CLUSTER); make cluster-down removes it")
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		if err := c.teardown(ctx); err != nil {
			t.Errorf("cluster: TEARDOWN FAILED, nodes or clusters may be left: %v", err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	t0 := time.Now()
	if err := c.teardown(ctx); err != nil {
		t.Fatalf("cluster: remove what an earlier run left: %v", err)
	}
	if rabbit {
		if err := c.upRabbit(ctx); err != nil {
			t.Fatalf("cluster: %v", err)
		}
	}
	if err := c.upPostgres(ctx); err != nil {
		t.Fatalf("cluster: %v", err)
	}
	what := ""
	if rabbit {
		what = fmt.Sprintf("%d RabbitMQ nodes joined (%s), ", clusterNodes, strings.Join(c.nodeNames(), ", "))
	}
	t.Logf("cluster: %sPostgres %s primary on %d with synchronous standby %s on %d, in %.1fs",
		what, c.pg[0], c.pg[0].port, c.pg[1], c.pg[1].port, time.Since(t0).Seconds())
	return c
}

func (c *cluster) nodeNames() []string {
	var out []string
	for _, n := range c.nodes {
		out = append(out, n.name)
	}
	return out
}

// upRabbit creates the three RabbitMQ nodes and joins them.
func (c *cluster) upRabbit(ctx context.Context) error {
	var wg sync.WaitGroup
	errs := make([]error, len(c.nodes))
	for i, n := range c.nodes {
		if err := n.prepare(); err != nil {
			return fmt.Errorf("prepare RabbitMQ node %s: %w", n.name, err)
		}
		wg.Go(func() { errs[i] = n.start(ctx) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	for _, n := range c.nodes[1:] {
		for _, args := range [][]string{{"stop_app"}, {"join_cluster", c.nodes[0].name}, {"start_app"}, {"await_startup", "--timeout", "120"}} {
			if _, err := n.ctl(ctx, args...); err != nil {
				return fmt.Errorf("join %s to %s: %w", n.name, c.nodes[0].name, err)
			}
		}
	}
	out, err := c.nodes[0].ctl(ctx, "cluster_status", "--formatter", "json", "-q")
	if err != nil {
		return err
	}
	var st struct {
		Running []string `json:"running_nodes"`
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		return fmt.Errorf("read cluster_status: %w", err)
	}
	if len(st.Running) != clusterNodes {
		return fmt.Errorf("cluster_status: running nodes %v, want %d", st.Running, clusterNodes)
	}
	return nil
}

// upPostgres creates the Postgres primary and its synchronous standby.
func (c *cluster) upPostgres(ctx context.Context) error {
	primary := c.pg[0]
	for _, p := range c.pg {
		if err := p.create(ctx, "--auth=trust"); err != nil {
			return fmt.Errorf("create Postgres %s: %w", p, err)
		}
	}
	if err := primary.start(ctx); err != nil {
		return err
	}
	c.primary = 0
	_, err := c.rebuildStandby(ctx)
	return err
}

// teardown stops the nodes and removes their data, and drops the Postgres
// clusters: the machine as it was before the run. It is a no-op when none
// exists.
func (c *cluster) teardown(ctx context.Context) error {
	var errs []error
	for _, n := range c.nodes {
		if _, err := os.Stat(n.base); errors.Is(err, os.ErrNotExist) {
			continue
		}
		if n.running(ctx) {
			if _, err := n.ctl(ctx, "stop"); err != nil {
				// Not answering a graceful stop: the data goes anyway.
				if kerr := n.kill(); kerr != nil {
					errs = append(errs, fmt.Errorf("stop %s: %w; kill: %w", n.name, err, kerr))
					continue
				}
			}
		}
		if err := os.RemoveAll(n.base); err != nil {
			errs = append(errs, err)
		}
	}
	for _, p := range c.pg {
		ok, err := p.exists(ctx)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if ok {
			if _, err := run(ctx, nil, "pg_dropcluster", "--stop", p.version, p.name); err != nil {
				errs = append(errs, err)
				continue
			}
		}
		// pg_dropcluster leaves the configuration directory when it holds a
		// file of its own making: the synchronous standby's conf.d file.
		if err := os.RemoveAll(filepath.Dir(filepath.Dir(p.syncConf()))); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// ---------------------------------------------------------------- RabbitMQ

// queueInfo is a queue as rabbitmqctl list_queues shows it.
type queueInfo struct {
	Name    string   `json:"name"`
	Leader  string   `json:"leader"`
	Members []string `json:"members"`
	Online  []string `json:"online"`
}

// upNode is a node no fault has stopped.
func (c *cluster) upNode() *rabbitNode {
	for i, n := range c.nodes {
		if !c.down[i] {
			return n
		}
	}
	return c.nodes[0]
}

// queues lists the cluster's queues, asked of a node that runs.
func (c *cluster) queues(ctx context.Context) (map[string]queueInfo, error) {
	out, err := c.upNode().ctl(ctx, "list_queues", "name", "leader", "members", "online", "--formatter", "json", "-q")
	if err != nil {
		return nil, err
	}
	var qs []queueInfo
	if err := json.Unmarshal([]byte(out), &qs); err != nil {
		return nil, fmt.Errorf("read list_queues: %w", err)
	}
	m := map[string]queueInfo{}
	for _, q := range qs {
		m[q.Name] = q
	}
	return m, nil
}

// checkReplicas fails unless every one of names is a queue with a member
// on each node, all online.
func (c *cluster) checkReplicas(ctx context.Context, names []string) error {
	qs, err := c.queues(ctx)
	if err != nil {
		return err
	}
	for _, name := range names {
		q, ok := qs[name]
		if !ok {
			return fmt.Errorf("queue %s is not declared", name)
		}
		if len(q.Members) != clusterNodes || len(q.Online) != clusterNodes {
			return fmt.Errorf("queue %s has members %v (online %v), want one on each of the %d nodes", name, q.Members, q.Online, clusterNodes)
		}
	}
	return nil
}

// killLeader stops the node that leads queue (rabbitmqctl stop_app, then
// SIGKILL of its VM) and waits until the queue has a new leader.
func (c *cluster) killLeader(ctx context.Context, queue string) (string, error) {
	qs, err := c.queues(ctx)
	if err != nil {
		return "", err
	}
	leader := qs[queue].Leader
	i := slices.IndexFunc(c.nodes, func(n *rabbitNode) bool { return n.name == leader })
	if i < 0 {
		return "", fmt.Errorf("queue %s has no leader among the nodes (%q)", queue, leader)
	}
	n := c.nodes[i]
	t0 := time.Now()
	_, stopErr := n.ctl(ctx, "stop_app")
	stopped := time.Since(t0)
	if err := n.kill(); err != nil {
		return "", fmt.Errorf("kill %s: %w (stop_app: %v)", n.name, err, stopErr)
	}
	c.down[i] = true
	var next string
	err = waitUntil(ctx, time.Minute, func() bool {
		qs, err := c.queues(ctx)
		next = qs[queue].Leader
		return err == nil && next != "" && next != leader
	})
	if err != nil {
		return "", fmt.Errorf("no new leader for %s after %s was killed: %w", queue, leader, err)
	}
	detail := fmt.Sprintf("%s led Q: stop_app (%.1fs), VM killed; %s leads after %.1fs", nodeName(leader), stopped.Seconds(), nodeName(next), time.Since(t0).Seconds())
	if stopErr != nil {
		detail += fmt.Sprintf(" (stop_app failed: %v)", stopErr)
	}
	return detail, nil
}

// nodeBack starts the nodes a fault stopped and waits until their member
// of queue is online again.
func (c *cluster) nodeBack(ctx context.Context, queue string) (string, error) {
	var parts []string
	for i, n := range c.nodes {
		if !c.down[i] {
			continue
		}
		t0 := time.Now()
		if err := n.start(ctx); err != nil {
			return "", err
		}
		up := time.Since(t0)
		err := waitUntil(ctx, time.Minute, func() bool {
			qs, err := c.queues(ctx)
			return err == nil && slices.Contains(qs[queue].Online, n.name)
		})
		if err != nil {
			return "", fmt.Errorf("%s back, but its member of %s is not online: %w", n.name, queue, err)
		}
		delete(c.down, i)
		parts = append(parts, fmt.Sprintf("%s started (up in %.1fs), its member of Q online %.1fs later", nodeName(n.name), up.Seconds(), (time.Since(t0)-up).Seconds()))
	}
	if len(parts) == 0 {
		return "no node was down", nil
	}
	return strings.Join(parts, "; "), nil
}

// kill ends a private node's VM with SIGKILL, as a crash would, and waits
// until it is gone.
func (n *rabbitNode) kill() error {
	raw, err := os.ReadFile(filepath.Join(n.base, "pid"))
	if err != nil {
		return fmt.Errorf("read pid file: %w", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(raw)))
	if err != nil {
		return fmt.Errorf("pid file: %w", err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return waitUntil(ctx, 30*time.Second, func() bool { return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) })
}

// nodeName is a node's name without @localhost.
func nodeName(node string) string { return strings.TrimSuffix(node, "@localhost") }

// ---------------------------------------------------------------- Postgres

func (p *pgCluster) dataDir() string {
	return filepath.Join("/var/lib/postgresql", p.version, p.name)
}

func (p *pgCluster) syncConf() string {
	return filepath.Join("/etc/postgresql", p.version, p.name, "conf.d", syncConfName)
}

// query runs one statement on p alone (not through the multi-host URL).
func (p *pgCluster) query(ctx context.Context, sql string, dest ...any) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, p.url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return conn.QueryRow(ctx, sql).Scan(dest...)
}

// failover stops the primary with -m immediate (a crash: what it had not
// sent its standby is gone), waits detect (the time a watchdog takes to
// notice), promotes the standby and waits until it takes writes.
func (c *cluster) failover(ctx context.Context, detect time.Duration) (string, error) {
	old, next := c.pg[c.primary], c.pg[1-c.primary]
	if err := old.ctl(ctx, "stop", "-m", "immediate"); err != nil {
		return "", fmt.Errorf("stop the primary %s: %w", old, err)
	}
	select {
	case <-ctx.Done():
	case <-time.After(detect):
	}
	t0 := time.Now()
	if err := next.ctl(context.WithoutCancel(ctx), "promote"); err != nil {
		return "", fmt.Errorf("promote %s: %w", next, err)
	}
	err := waitUntil(context.WithoutCancel(ctx), time.Minute, func() bool {
		var writable bool
		return next.query(ctx, "SELECT NOT pg_is_in_recovery()", &writable) == nil && writable
	})
	if err != nil {
		return "", fmt.Errorf("%s promoted but does not take writes: %w", next, err)
	}
	c.primary = 1 - c.primary
	return fmt.Sprintf("primary %s stopped -m immediate, standby %s promoted %.1fs later (takes writes in %.1fs; no synchronous standby until it is re-created)",
		old, next, detect.Seconds(), time.Since(t0).Seconds()), nil
}

// rebuildStandby makes the server that is not the primary a streaming
// standby of it again, from a fresh pg_basebackup over its data directory,
// then makes the primary wait for it (synchronous_standby_names).
func (c *cluster) rebuildStandby(ctx context.Context) (string, error) {
	src, dst := c.pg[c.primary], c.pg[1-c.primary]
	t0 := time.Now()
	_ = dst.ctl(ctx, "stop", "-m", "immediate") // down already after a failover
	if err := os.Remove(dst.syncConf()); err != nil && !errors.Is(err, os.ErrNotExist) {
		return "", err
	}
	// pg_basebackup fills an empty directory; the parent belongs to root.
	if err := os.RemoveAll(dst.dataDir()); err != nil {
		return "", err
	}
	if err := os.Mkdir(dst.dataDir(), 0o700); err != nil {
		return "", err
	}
	if _, err := run(ctx, nil, "chown", "postgres:postgres", dst.dataDir()); err != nil {
		return "", err
	}
	basebackup := filepath.Join("/usr/lib/postgresql", dst.version, "bin", "pg_basebackup")
	if _, err := run(ctx, nil, "runuser", "-u", "postgres", "--", basebackup,
		"-h", "127.0.0.1", "-p", strconv.Itoa(src.port), "-U", "postgres", "-D", dst.dataDir(),
		"-R", "-X", "stream", "-c", "fast"); err != nil {
		return "", fmt.Errorf("pg_basebackup of %s onto %s: %w", src, dst, err)
	}
	copied := time.Since(t0)
	if err := dst.start(ctx); err != nil {
		return "", err
	}
	err := waitUntil(ctx, time.Minute, func() bool {
		var n int
		return src.query(ctx, "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'", &n) == nil && n > 0
	})
	if err != nil {
		return "", fmt.Errorf("standby %s does not stream from %s: %w", dst, src, err)
	}
	streaming := time.Since(t0)
	// The primary waits for its standby only now that one streams: with
	// synchronous_standby_names set and no standby, every commit would
	// wait (see docs/operations.md, Production topology).
	conf := "# Written by the idemq cluster soak: commits wait for the standby's flush.\nsynchronous_standby_names = '*'\nsynchronous_commit = on\n"
	if err := os.WriteFile(src.syncConf(), []byte(conf), 0o644); err != nil {
		return "", err
	}
	var reloaded bool
	if err := src.query(ctx, "SELECT pg_reload_conf()", &reloaded); err != nil {
		return "", fmt.Errorf("reload %s: %w", src, err)
	}
	err = waitUntil(ctx, time.Minute, func() bool {
		var n int
		return src.query(ctx, "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'", &n) == nil && n > 0
	})
	if err != nil {
		return "", fmt.Errorf("standby %s is not synchronous: %w", dst, err)
	}
	return fmt.Sprintf("%s re-created from %s (pg_basebackup %.1fs), streaming after %.1fs, synchronous after %.1fs",
		dst, src, copied.Seconds(), streaming.Seconds(), time.Since(t0).Seconds()), nil
}
