package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// The Postgres of cluster mode: three members under Patroni (Debian's
// patroni 3.0) with one etcd (Debian's etcd-server 3.4) as its
// configuration store, all created for the run under patroniBase and run
// as the postgres user (Postgres refuses root):
//
//   - etcd: one member, clients on 127.0.0.1:23790, peers on 23800, data
//     in patroniBase/etcd;
//   - Patroni members pg1, pg2, pg3: Postgres 15 on 127.0.0.1:5452-5454,
//     Patroni's REST API on 8452-8454, data in patroniBase/pgN, trust
//     authentication on 127.0.0.1. The first to start bootstraps the
//     cluster (initdb), the others clone it (pg_basebackup) and stream.
//   - synchronous_mode: true. Patroni names one replica the synchronous
//     standby (synchronous_standby_names), and only that one may be promoted
//     when the leader is lost, so that no commit the leader acknowledged is
//     lost in the failover; the third member streams asynchronously.
//     primary_start_timeout: 0: a leader whose Postgres crashed fails over
//     at once rather than being restarted in place; use_pg_rewind (with
//     wal_log_hints) brings it back as a replica of the new leader, and
//     where a rewind cannot, its data directory is made anew
//     (remove_data_directory_on_rewind_failure, …_on_diverged_timelines).
//     ttl 20 s, loop_wait 2 s, retry_timeout 5 s: a crash is seen within a
//     loop, and a member whose Patroni is gone loses its lock after 20 s.
//
// Clients name the three servers in one URL with
// target_session_attrs=read-write: pgx tries them in order and keeps the
// one that takes writes, the leader. (HAProxy on Patroni's REST health
// checks would do the same with one address, one more process to run.)
const (
	patroniBase       = "/var/lib/postgresql/idemq-patroni"
	patroniScope      = "idemq"
	patroniMembers    = 3
	patroniPGBase     = 5451 // member i (1…3) listens on patroniPGBase+i
	patroniRESTBase   = 8451 // and serves Patroni's REST API on patroniRESTBase+i
	patroniEtcdClient = 23790
	patroniEtcdPeer   = 23800
	patroniPGBin      = "/usr/lib/postgresql/15/bin"
)

// patroni is the Postgres of cluster mode. Only one goroutine (the fault
// injector, then the cleanups) uses it, but for rejoined, which a watcher
// started by failover fills.
type patroni struct {
	base    string
	members []*pgMember
	// rejoined reports when the member whose Postgres failover killed is
	// a replica of the new leader again (nil when no failover is pending).
	rejoined <-chan rejoin
	// killed is the member failover killed.
	killed *pgMember
	killAt time.Time
	// stopWatch ends the watcher of rejoined.
	stopWatch context.CancelFunc
}

// pgMember is one Patroni member: its Postgres and its REST API.
type pgMember struct {
	name           string
	port, restPort int
	dir            string
	// url reaches this server alone (not through the multi-host URL).
	url string
}

func (m *pgMember) String() string { return m.name }

// query runs one statement on m alone.
func (m *pgMember) query(ctx context.Context, sql string, dest ...any) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, m.url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return conn.QueryRow(ctx, sql).Scan(dest...)
}

func newPatroni() *patroni {
	p := &patroni{base: patroniBase}
	for i := 1; i <= patroniMembers; i++ {
		m := &pgMember{name: fmt.Sprintf("pg%d", i), port: patroniPGBase + i, restPort: patroniRESTBase + i,
			dir: filepath.Join(p.base, fmt.Sprintf("pg%d", i))}
		m.url = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", m.port)
		p.members = append(p.members, m)
	}
	return p
}

// url names the three servers; pgx connects to the one that takes writes.
func (p *patroni) url() string {
	var hosts []string
	for _, m := range p.members {
		hosts = append(hosts, fmt.Sprintf("127.0.0.1:%d", m.port))
	}
	return "postgres://postgres@" + strings.Join(hosts, ",") + "/postgres?sslmode=disable&target_session_attrs=read-write"
}

func (p *patroni) names() []string {
	var out []string
	for _, m := range p.members {
		out = append(out, m.name)
	}
	return out
}

func (p *patroni) configPath(m *pgMember) string { return filepath.Join(p.base, m.name+".yml") }
func (p *patroni) logPath(name string) string    { return filepath.Join(p.base, name+".log") }
func (p *patroni) pidPath(name string) string    { return filepath.Join(p.base, name+".pid") }

// config is member m's Patroni configuration. The bootstrap section is
// read by the member that initialises the cluster and written to etcd,
// from where every member takes it.
func (p *patroni) config(m *pgMember) string {
	return fmt.Sprintf(`# Written by the idemq cluster soak (cluster_test.go, patroni_test.go).
scope: %[1]s
namespace: /idemq/
name: %[2]s
restapi:
  listen: 127.0.0.1:%[3]d
  connect_address: 127.0.0.1:%[3]d
etcd3:
  hosts: 127.0.0.1:%[4]d
bootstrap:
  dcs:
    ttl: 20
    loop_wait: 2
    retry_timeout: 5
    maximum_lag_on_failover: 1048576
    primary_start_timeout: 0
    synchronous_mode: true
    postgresql:
      use_pg_rewind: true
      remove_data_directory_on_rewind_failure: true
      remove_data_directory_on_diverged_timelines: true
      parameters:
        wal_log_hints: "on"
        synchronous_commit: "on"
        max_connections: 200
        max_wal_senders: 10
        max_replication_slots: 10
  initdb:
    - encoding: UTF8
    - auth: trust
  pg_hba:
    - local all all trust
    - host all all 127.0.0.1/32 trust
    - host replication all 127.0.0.1/32 trust
postgresql:
  listen: 127.0.0.1:%[5]d
  connect_address: 127.0.0.1:%[5]d
  data_dir: %[6]s
  bin_dir: %[7]s
  pgpass: %[8]s
  authentication:
    superuser: {username: postgres}
    replication: {username: postgres}
    rewind: {username: postgres}
  parameters:
    unix_socket_directories: %[9]s
`, patroniScope, m.name, m.restPort, patroniEtcdClient, m.port, m.dir, patroniPGBin,
		filepath.Join(p.base, m.name+".pgpass"), p.base)
}

// up creates etcd and the three members from nothing (teardown first) and
// waits until the cluster is whole: a leader, a synchronous standby and a
// replica, both streaming.
func (p *patroni) up(ctx context.Context) error {
	ports := []int{patroniEtcdClient, patroniEtcdPeer}
	for _, m := range p.members {
		ports = append(ports, m.port, m.restPort)
	}
	for _, port := range ports {
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			return fmt.Errorf("port %d, needed by the Patroni cluster, is taken by another process: %w", port, err)
		}
		_ = l.Close()
	}
	pgUser, err := user.Lookup("postgres")
	if err != nil {
		return fmt.Errorf("the postgres user (Debian's postgresql package): %w", err)
	}
	if err := os.Mkdir(p.base, 0o700); err != nil {
		return fmt.Errorf("create %s: %w", p.base, err)
	}
	for _, m := range p.members {
		if err := os.WriteFile(p.configPath(m), []byte(p.config(m)), 0o600); err != nil {
			return err
		}
	}
	if _, err := run(ctx, nil, "chown", "-R", "postgres:postgres", p.base); err != nil {
		return err
	}
	etcd := []string{"--name", "idemq-etcd", "--data-dir", filepath.Join(p.base, "etcd"),
		"--listen-client-urls", fmt.Sprintf("http://127.0.0.1:%d", patroniEtcdClient),
		"--advertise-client-urls", fmt.Sprintf("http://127.0.0.1:%d", patroniEtcdClient),
		"--listen-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", patroniEtcdPeer),
		"--initial-advertise-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", patroniEtcdPeer),
		"--initial-cluster", fmt.Sprintf("idemq-etcd=http://127.0.0.1:%d", patroniEtcdPeer),
		"--initial-cluster-state", "new", "--initial-cluster-token", "idemq-patroni"}
	if err := p.daemon(pgUser, "etcd", "/usr/bin/etcd", etcd...); err != nil {
		return err
	}
	err = waitUntil(ctx, time.Minute, func() bool {
		var h struct {
			Health string `json:"health"`
		}
		return getJSON(ctx, fmt.Sprintf("http://127.0.0.1:%d/health", patroniEtcdClient), &h) == nil && h.Health == "true"
	})
	if err != nil {
		return fmt.Errorf("etcd does not become healthy (log %s): %w", p.logPath("etcd"), err)
	}
	for _, m := range p.members {
		if err := p.daemon(pgUser, m.name, "/usr/bin/patroni", p.configPath(m)); err != nil {
			return err
		}
	}
	if _, err := p.awaitWhole(ctx, 3*time.Minute); err != nil {
		return fmt.Errorf("the Patroni cluster does not form (logs %s/pgN.log): %w", p.base, err)
	}
	return nil
}

// daemon starts a long-running program as the postgres user, in a session
// of its own so that it outlives the test process (make cluster-up), its
// output in the log file of name, and records its pid for teardown.
func (p *patroni) daemon(u *user.User, name, path string, args ...string) error {
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return err
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return err
	}
	log, err := os.OpenFile(p.logPath(name), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer log.Close()
	cmd := exec.Command(path, args...)
	cmd.Dir = p.base
	cmd.Env = []string{"PATH=/usr/bin:/bin", "HOME=" + p.base, "LANG=C.UTF-8"}
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", name, err)
	}
	// Reaped while this process lives; after it, init adopts it.
	go func() { _ = cmd.Wait() }()
	return os.WriteFile(p.pidPath(name), []byte(strconv.Itoa(cmd.Process.Pid)), 0o644)
}

// teardown stops the members, their Postgres and etcd, and removes
// patroniBase: the machine as it was before the run. It is a no-op when
// nothing is there.
func (p *patroni) teardown(ctx context.Context) error {
	if p.stopWatch != nil {
		p.stopWatch()
	}
	if _, err := os.Stat(p.base); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	var errs []error
	// Patroni first (SIGTERM: it stops its Postgres, -m fast, and exits),
	// all at once so that none fails over to another; then any Postgres a
	// killed Patroni left; etcd last.
	errs = append(errs, p.stopAll(ctx, p.names(), 60*time.Second))
	for _, m := range p.members {
		if pid, err := m.postmasterPID(); err == nil {
			errs = append(errs, stopPID(ctx, pid, m.dir, syscall.SIGQUIT, 30*time.Second))
		}
	}
	errs = append(errs, p.stopAll(ctx, []string{"etcd"}, 30*time.Second))
	if err := errors.Join(errs...); err != nil {
		return err
	}
	return os.RemoveAll(p.base)
}

// stopAll sends SIGTERM to the daemons named, as their pid files name
// them, and waits until they are gone (SIGKILL after timeout).
func (p *patroni) stopAll(ctx context.Context, names []string, timeout time.Duration) error {
	errs := make([]error, len(names))
	done := make(chan struct{})
	for i, name := range names {
		go func() {
			defer func() { done <- struct{}{} }()
			raw, err := os.ReadFile(p.pidPath(name))
			if errors.Is(err, os.ErrNotExist) {
				return
			}
			pid, err := strconv.Atoi(strings.TrimSpace(string(raw)))
			if err != nil {
				errs[i] = fmt.Errorf("pid file of %s: %w", name, err)
				return
			}
			errs[i] = stopPID(ctx, pid, p.base, syscall.SIGTERM, timeout)
		}()
	}
	for range names {
		<-done
	}
	return errors.Join(errs...)
}

// stopPID sends sig to pid and waits until it is gone, then SIGKILL and
// waits again. A pid whose command line does not name mark is another
// process that took a stale pid file's number, and is left alone.
func stopPID(ctx context.Context, pid int, mark string, sig syscall.Signal, timeout time.Duration) error {
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil || !bytes.Contains(cmdline, []byte(mark)) {
		return nil
	}
	gone := func() bool {
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		// A zombie (state Z) is gone as far as its work goes.
		return err != nil || bytes.Contains(stat, []byte(") Z "))
	}
	if err := syscall.Kill(pid, sig); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("signal pid %d: %w", pid, err)
	}
	if waitUntil(ctx, timeout, gone) == nil {
		return nil
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("kill pid %d: %w", pid, err)
	}
	if err := waitUntil(ctx, 30*time.Second, gone); err != nil {
		return fmt.Errorf("pid %d (%s) does not end after SIGKILL: %w", pid, strings.ReplaceAll(string(cmdline), "\x00", " "), err)
	}
	return nil
}

// postmasterPID is the pid of the member's Postgres, from its
// postmaster.pid (an error when it does not run).
func (m *pgMember) postmasterPID() (int, error) {
	raw, err := os.ReadFile(filepath.Join(m.dir, "postmaster.pid"))
	if err != nil {
		return 0, err
	}
	first, _, _ := strings.Cut(string(raw), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(first))
	if err != nil {
		return 0, fmt.Errorf("postmaster.pid of %s: %w", m, err)
	}
	if err := syscall.Kill(pid, 0); err != nil {
		return 0, fmt.Errorf("postmaster of %s (pid %d): %w", m, pid, err)
	}
	return pid, nil
}

// ---------------------------------------------------------------- state

// memberState is one member as Patroni's GET /cluster shows it.
type memberState struct {
	Name     string `json:"name"`
	Role     string `json:"role"` // leader, sync_standby, replica
	State    string `json:"state"`
	Timeline int    `json:"timeline"`
}

// clusterState is what GET /cluster answers, asked of any member whose
// REST API answers (each shows the state in etcd).
type clusterState struct {
	Members []memberState `json:"members"`
}

func (s clusterState) role(role string) (memberState, bool) {
	i := slices.IndexFunc(s.Members, func(m memberState) bool { return m.Role == role })
	if i < 0 {
		return memberState{}, false
	}
	return s.Members[i], true
}

func (s clusterState) String() string {
	var parts []string
	for _, m := range s.Members {
		parts = append(parts, fmt.Sprintf("%s %s %s tl %d", m.Name, m.Role, m.State, m.Timeline))
	}
	return strings.Join(parts, ", ")
}

func (p *patroni) state(ctx context.Context) (clusterState, error) {
	var errs []error
	for _, m := range p.members {
		var st clusterState
		err := getJSON(ctx, fmt.Sprintf("http://127.0.0.1:%d/cluster", m.restPort), &st)
		if err == nil {
			return st, nil
		}
		errs = append(errs, err)
	}
	return clusterState{}, fmt.Errorf("no Patroni REST API answers: %w", errors.Join(errs...))
}

func (p *patroni) member(name string) *pgMember {
	i := slices.IndexFunc(p.members, func(m *pgMember) bool { return m.name == name })
	if i < 0 {
		return nil
	}
	return p.members[i]
}

// whole reports whether the cluster is whole: all members running on one
// timeline, a leader that takes writes and streams to the other two, one of
// them synchronously.
func (p *patroni) whole(ctx context.Context) (clusterState, error) {
	st, err := p.state(ctx)
	if err != nil {
		return st, err
	}
	leader, ok := st.role("leader")
	if !ok {
		return st, fmt.Errorf("no leader: %s", st)
	}
	if _, ok := st.role("sync_standby"); !ok {
		return st, fmt.Errorf("no synchronous standby: %s", st)
	}
	if len(st.Members) != patroniMembers {
		return st, fmt.Errorf("%d members, want %d: %s", len(st.Members), patroniMembers, st)
	}
	for _, m := range st.Members {
		if m.State != "running" || m.Timeline != leader.Timeline {
			return st, fmt.Errorf("not every member runs on the leader's timeline: %s", st)
		}
	}
	var writable bool
	var streaming, sync int
	l := p.member(leader.Name)
	if err := l.query(ctx, "SELECT NOT pg_is_in_recovery()", &writable); err != nil || !writable {
		return st, fmt.Errorf("leader %s does not take writes (%v): %s", l, err, st)
	}
	err = l.query(ctx, "SELECT count(*) FILTER (WHERE state = 'streaming'), count(*) FILTER (WHERE state = 'streaming' AND sync_state = 'sync') FROM pg_stat_replication", &streaming, &sync)
	if err != nil || streaming != patroniMembers-1 || sync != 1 {
		return st, fmt.Errorf("leader %s streams to %d replicas, %d synchronously (%v): %s", l, streaming, sync, err, st)
	}
	return st, nil
}

// awaitWhole waits until the cluster is whole (see whole).
func (p *patroni) awaitWhole(ctx context.Context, timeout time.Duration) (clusterState, error) {
	var st clusterState
	var last error
	err := waitUntil(ctx, timeout, func() bool {
		st, last = p.whole(ctx)
		return last == nil
	})
	if err != nil {
		return st, fmt.Errorf("%w: %v", err, last)
	}
	return st, nil
}

// awaitLeader waits until a member other than old leads and takes writes.
func (p *patroni) awaitLeader(ctx context.Context, old string, timeout time.Duration) (*pgMember, clusterState, error) {
	var next *pgMember
	var st clusterState
	err := waitUntil(ctx, timeout, func() bool {
		var err error
		if st, err = p.state(ctx); err != nil {
			return false
		}
		l, ok := st.role("leader")
		if !ok || l.Name == old {
			return false
		}
		next = p.member(l.Name)
		var writable bool
		return next.query(ctx, "SELECT NOT pg_is_in_recovery()", &writable) == nil && writable
	})
	if err != nil {
		return nil, st, fmt.Errorf("no new leader after %s: %w (%s)", old, err, st)
	}
	return next, st, nil
}

// ---------------------------------------------------------------- faults

// rejoin is when a member killed by failover was a replica again.
type rejoin struct {
	at time.Time
	st clusterState
}

// failover kills the leader's postmaster (SIGKILL: a crash, what it had not
// sent is gone) and waits until Patroni has elected a new leader that takes
// writes: the synchronous standby, the one member synchronous_mode lets it
// promote. Then it leaves the old leader to Patroni, which starts it as a
// replica of the new one (pg_rewind), and watches for that (rejoin).
func (p *patroni) failover(ctx context.Context) (string, error) {
	st, err := p.awaitWhole(ctx, 2*time.Minute)
	if err != nil {
		return "", fmt.Errorf("the Patroni cluster is not whole before the failover: %w", err)
	}
	leader, _ := st.role("leader")
	standby, _ := st.role("sync_standby")
	old := p.member(leader.Name)
	killed, err := p.killPostmaster(old)
	if err != nil {
		return "", err
	}
	next, after, err := p.awaitLeader(ctx, old.name, time.Minute)
	if err != nil {
		return "", err
	}
	elected := time.Since(killed)
	p.watchRejoin(old, killed)
	if next.name != standby.Name {
		return "", fmt.Errorf("%s was promoted, not the synchronous standby %s (before: %s; after: %s)", next, standby.Name, st, after)
	}
	return fmt.Sprintf("leader %s: postmaster killed (SIGKILL); the synchronous standby %s leads and takes writes %.1fs later",
		old, next, elected.Seconds()), nil
}

// killPostmaster ends m's Postgres with SIGKILL and returns when.
func (p *patroni) killPostmaster(m *pgMember) (time.Time, error) {
	pid, err := m.postmasterPID()
	if err != nil {
		return time.Time{}, fmt.Errorf("find the postmaster of the leader %s: %w", m, err)
	}
	t0 := time.Now()
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return time.Time{}, fmt.Errorf("kill the postmaster of %s: %w", m, err)
	}
	return t0, nil
}

// watchRejoin watches, in a goroutine of its own, for the killed member to
// run as a replica of the leader's timeline and the cluster to be whole
// again; rejoined reports when (or is closed after ten minutes).
func (p *patroni) watchRejoin(m *pgMember, killed time.Time) {
	ch := make(chan rejoin, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	p.rejoined, p.killed, p.killAt, p.stopWatch = ch, m, killed, cancel
	go func() {
		defer close(ch)
		var st clusterState
		err := waitUntil(ctx, 10*time.Minute, func() bool {
			var err error
			st, err = p.whole(ctx)
			if err != nil {
				return false
			}
			var replica bool
			return m.query(ctx, "SELECT pg_is_in_recovery()", &replica) == nil && replica
		})
		if err == nil {
			ch <- rejoin{at: time.Now(), st: st}
		}
	}()
}

// rejoin waits until the member failover killed is a replica again (Patroni
// does it: crash recovery, pg_rewind, start as a replica), and the cluster
// whole. When it is not within two minutes it asks Patroni for a new copy
// (patronictl reinit) and waits again.
func (p *patroni) rejoin(ctx context.Context) (string, error) {
	if p.rejoined == nil {
		return "no failover to recover from", nil
	}
	m, killed, ch := p.killed, p.killAt, p.rejoined
	defer p.stopWatch()
	p.rejoined, p.killed = nil, nil
	rewound := strings.Count(p.log(m), "running pg_rewind from")
	select {
	case r, ok := <-ch:
		if ok {
			how := "restarted as a replica"
			if rewound > 0 {
				how = "rewound (pg_rewind) and restarted as a replica"
			}
			role := "replica"
			if mm, ok := r.st.role("sync_standby"); ok && mm.Name == m.name {
				role = "synchronous standby"
			}
			return fmt.Sprintf("%s %s by Patroni, streaming %.1fs after the kill, now a %s on timeline %d",
				m, how, r.at.Sub(killed).Seconds(), role, timelineOf(r.st, m.name)), nil
		}
	case <-time.After(max(2*time.Minute-time.Since(killed), 0)):
	case <-ctx.Done():
		return "", ctx.Err()
	}
	st, _ := p.state(ctx)
	if _, err := run(ctx, nil, "patronictl", "-c", p.configPath(m), "reinit", "--force", "--wait", patroniScope, m.name); err != nil {
		return "", fmt.Errorf("%s is not back as a replica (%s), and patronictl reinit failed: %w", m, st, err)
	}
	after, err := p.awaitWhole(ctx, 3*time.Minute)
	if err != nil {
		return "", fmt.Errorf("%s reinitialised, the cluster still not whole: %w", m, err)
	}
	return fmt.Sprintf("%s not back as a replica within 2 min (%s): patronictl reinit, whole %.1fs after the kill (%s)",
		m, st, time.Since(killed).Seconds(), after), nil
}

// switchover is the planned change of leader: patronictl switchover
// --force, Patroni choosing the candidate (in synchronous mode, the
// synchronous standby). The old leader stops (-m fast: its clients get
// admin_shutdown), the candidate is promoted once it has all of the old
// leader's WAL, and the old leader restarts as a replica. It waits until the
// new leader takes writes and the cluster is whole again.
func (p *patroni) switchover(ctx context.Context) (string, error) {
	st, err := p.awaitWhole(ctx, 2*time.Minute)
	if err != nil {
		return "", fmt.Errorf("the Patroni cluster is not whole before the switchover: %w", err)
	}
	leader, _ := st.role("leader")
	old := p.member(leader.Name)
	t0 := time.Now()
	if _, err := run(ctx, nil, "patronictl", "-c", p.configPath(old), "switchover", "--force", "--leader", old.name, patroniScope); err != nil {
		return "", err
	}
	next, _, err := p.awaitLeader(ctx, old.name, time.Minute)
	if err != nil {
		return "", err
	}
	elected := time.Since(t0)
	after, err := p.awaitWhole(ctx, 3*time.Minute)
	if err != nil {
		return "", fmt.Errorf("after the switchover from %s to %s: %w", old, next, err)
	}
	return fmt.Sprintf("patronictl switchover from %s: %s leads and takes writes %.1fs later, %s a replica and the cluster whole after %.1fs (timeline %d)",
		old, next, elected.Seconds(), old, time.Since(t0).Seconds(), timelineOf(after, next.name)), nil
}

// log is member m's log (Patroni's and its Postgres's output).
func (p *patroni) log(m *pgMember) string {
	raw, _ := os.ReadFile(p.logPath(m.name))
	return string(raw)
}

// keepLogs copies the logs of etcd and the members into a new temporary
// directory and returns it.
func (p *patroni) keepLogs() (string, error) {
	dir, err := os.MkdirTemp("", "idemq-patroni-logs-")
	if err != nil {
		return "", err
	}
	for _, name := range append([]string{"etcd"}, p.names()...) {
		raw, err := os.ReadFile(p.logPath(name))
		if err != nil {
			continue
		}
		if err := os.WriteFile(filepath.Join(dir, name+".log"), raw, 0o644); err != nil {
			return dir, err
		}
	}
	return dir, nil
}

func timelineOf(st clusterState, name string) int {
	for _, m := range st.Members {
		if m.Name == name {
			return m.Timeline
		}
	}
	return 0
}

// getJSON GETs url and decodes its JSON answer into v.
func getJSON(ctx context.Context, url string, v any) error {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("read %s: %w", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s: %s", url, resp.Status, bytes.TrimSpace(body))
	}
	if err := json.Unmarshal(body, v); err != nil {
		return fmt.Errorf("decode %s: %w", url, err)
	}
	return nil
}
