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
)

// The production topology on one machine (make cluster, TestSoakCluster):
//
//   - RabbitMQ: three nodes idemq-c1@localhost … idemq-c3@localhost of the
//     Debian rabbitmq-server, AMQP on 127.0.0.1:5701-5703, distribution on
//     25701-25703, data under /var/lib/rabbitmq/idemq-cN, no plugins, the
//     rabbitmq user's Erlang cookie, joined with rabbitmqctl stop_app,
//     join_cluster idemq-c1@localhost, start_app. Quorum queues declared
//     while the three run get a member on each.
//   - Postgres: three members pg1, pg2, pg3 under Patroni, on
//     127.0.0.1:5452-5454 (REST API on 8452-8454), with one etcd on
//     127.0.0.1:23790 (peers 23800), in synchronous mode: a leader, a
//     synchronous standby that Patroni promotes when the leader is lost,
//     and an asynchronous replica; everything under
//     /var/lib/postgresql/idemq-patroni, run as the postgres user (see
//     patroni_test.go). Clients name the three servers in one URL with
//     target_session_attrs=read-write.
//
// Everything is created from nothing at the start of a run (what an earlier,
// killed, run left is torn down first) and torn down at the end: nodes
// stopped, their data removed; Patroni, its Postgres servers and etcd
// stopped, their directory removed. IDEMQ_CHAOS_KEEP_CLUSTER=1 leaves them
// running after the run.
const (
	clusterNodes    = 3
	clusterAMQPBase = 5700 // node i listens on clusterAMQPBase+i
	clusterDistBase = 25700
)

// cluster is the topology of cluster mode and the state the faults leave
// it in. Only one goroutine (the fault injector, then the cleanups) uses it.
type cluster struct {
	nodes []*rabbitNode
	// down marks the nodes a fault stopped.
	down map[int]bool
	pg   *patroni
}

func newCluster() *cluster {
	c := &cluster{down: map[int]bool{}, pg: newPatroni()}
	for i := 1; i <= clusterNodes; i++ {
		c.nodes = append(c.nodes, newPrivateNode(fmt.Sprintf("idemq-c%d@localhost", i),
			clusterAMQPBase+i, clusterDistBase+i, fmt.Sprintf("/var/lib/rabbitmq/idemq-c%d", i)))
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

// pgURL names the three Postgres servers; pgx connects to the one that
// takes writes, Patroni's leader.
func (c *cluster) pgURL() string { return c.pg.url() }

// newClusterServices creates the cluster topology for t and tears it down
// when t ends.
func newClusterServices(t *testing.T) *services {
	t.Helper()
	c := setUpCluster(t, true)
	return &services{mode: "cluster", cluster: c, pgURL: c.pgURL(), amqpURL: c.nodes[0].url, amqpURLs: c.amqpURLs(),
		pgHostPort: "cluster", amqpHostPort: "cluster"}
}

// setUpCluster creates the Patroni cluster, and the RabbitMQ nodes when
// rabbit is set, for t, removing first what an earlier run left, and tears
// them down when t ends. The logs of etcd and Patroni are kept when t fails.
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
		if t.Failed() {
			dir, err := c.pg.keepLogs()
			t.Logf("cluster: logs of etcd and Patroni kept in %s (%v)", dir, err)
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
	if err := c.pg.up(ctx); err != nil {
		t.Fatalf("cluster: %v", err)
	}
	what := ""
	if rabbit {
		what = fmt.Sprintf("%d RabbitMQ nodes joined (%s), ", clusterNodes, strings.Join(c.nodeNames(), ", "))
	}
	st, err := c.pg.state(ctx)
	if err != nil {
		t.Fatalf("cluster: %v", err)
	}
	t.Logf("cluster: %sPostgres under Patroni (%s), in %.1fs", what, st, time.Since(t0).Seconds())
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

// teardown stops the nodes and removes their data, and removes the
// Patroni cluster: the machine as it was before the run. It is a no-op when
// none exists.
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
	if err := c.pg.teardown(ctx); err != nil {
		errs = append(errs, fmt.Errorf("remove the Patroni cluster: %w", err))
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
