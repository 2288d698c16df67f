package chaos

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// The fault kinds, in the order of the report.
const (
	faultWorkerKill = "worker_sigkill"
	// faultActiveKill kills the worker that is the single active consumer
	// of a partition (an ordered soak): the broker hands the partition to
	// a standby.
	faultActiveKill   = "active_consumer_sigkill"
	faultCloseAll     = "amqp_close_all_connections"
	faultBrokerStop   = "broker_stop_app"
	faultPGTerminate  = "pg_terminate_backend"
	faultPGRestart    = "pg_restart_fast"
	faultPGStopImmed  = "pg_stop_immediate"
	faultNetLatency   = "net_latency"
	faultNetBlackhole = "net_timeout"
	faultNetResetPeer = "net_reset_peer"
	faultDeleteTier   = "delete_retry_tier"
	faultDeleteDLQ    = "delete_dlq"
	// The faults of the cluster topology (cluster_test.go), each followed
	// by the step that restores redundancy.
	faultRabbitLeaderDown = "rabbit_leader_down"
	faultRabbitNodeBack   = "rabbit_node_back"
	faultPGFailover       = "pg_leader_sigkill"
	faultPGRejoin         = "pg_leader_rejoined"
	faultPGSwitchover     = "pg_switchover"
	proxyPostgres         = "postgres"
	proxyRabbitMQ         = "rabbitmq"
	maxFaultHoldSeconds   = 8
)

var faultKinds = []string{
	faultWorkerKill, faultCloseAll, faultBrokerStop, faultPGTerminate, faultPGRestart,
	faultPGStopImmed, faultNetLatency, faultNetBlackhole, faultNetResetPeer,
	faultDeleteTier, faultDeleteDLQ,
}

// clusterFaultKinds are the faults drawn on the cluster topology.
var clusterFaultKinds = []string{faultRabbitLeaderDown, faultPGFailover, faultPGSwitchover}

// followUps are the steps that come after a fault, once it was held a
// while: the node brought back, the old Postgres leader a replica again.
// Each is recorded (with its recovery time) as a fault of its own kind.
var followUps = map[string]string{
	faultRabbitLeaderDown: faultRabbitNodeBack,
	faultPGFailover:       faultPGRejoin,
}

// drawn are the fault kinds the run draws from.
func (o soakOptions) drawn() []string {
	if o.Kinds == nil {
		return faultKinds
	}
	return o.Kinds
}

// kinds are the fault kinds of the run, drawn ones and follow-ups, in the
// order of the report.
func (o soakOptions) kinds() []string {
	var out []string
	for _, k := range o.drawn() {
		out = append(out, k)
		if f := followUps[k]; f != "" {
			out = append(out, f)
		}
	}
	return out
}

// faultRecord is one injected fault.
type faultRecord struct {
	Kind   string
	Detail string
	Start  time.Time
	// End is when the fault was over: the service back, the toxic removed,
	// the worker restarted.
	End time.Time
	// Recovery is the time from End to the next progress of the soak
	// (0 while not measured yet).
	Recovery time.Duration
	// Idle marks a fault injected after the work was done: no progress to measure.
	Idle bool
	Err  error
}

// injectFaults injects faults at random intervals until the work is done
// (and, with EveryKind, every kind was injected), the run stalls (true) or
// ctx ends.
func (s *soak) injectFaults(ctx context.Context) (stalled bool) {
	drawn := s.o.drawn()
	var required []string
	if s.o.EveryKind {
		for range max(s.o.Rounds, 1) {
			round := slices.Clone(drawn)
			s.rng.Shuffle(len(round), func(i, j int) { round[i], round[j] = round[j], round[i] })
			required = append(required, round...)
		}
	}
	for {
		gap := s.o.FaultGap[0] + time.Duration(s.rng.Int64N(int64(s.o.FaultGap[1]-s.o.FaultGap[0])+1))
		deadline := time.Now().Add(gap)
		for time.Now().Before(deadline) {
			if ctx.Err() != nil {
				return false
			}
			if s.stalledFor() > s.o.StallTimeout {
				s.problem(fmt.Sprintf("no progress for %s: %s", s.o.StallTimeout, s.diagnose(ctx)))
				return true
			}
			select {
			case <-ctx.Done():
			case <-time.After(500 * time.Millisecond):
			}
		}
		if len(required) == 0 && s.settled(ctx) {
			return false
		}
		kind := drawn[s.rng.IntN(len(drawn))]
		if len(required) > 0 {
			kind, required = required[0], required[1:]
		}
		s.inject(ctx, kind)
		if next := followUps[kind]; next != "" {
			// The work goes on without the node or the old leader meanwhile.
			s.pause(ctx, s.hold(s.o.FaultGap[0].Seconds(), s.o.FaultGap[1].Seconds()))
			s.inject(context.WithoutCancel(ctx), next)
		}
	}
}

// inject runs one fault and records it. Every fault restores what it broke
// before it returns, also when it fails.
func (s *soak) inject(ctx context.Context, kind string) {
	f := &faultRecord{Kind: kind, Start: time.Now()}
	s.faultMu.Lock()
	s.faults = append(s.faults, f)
	s.faultMu.Unlock()
	detail, err := s.fault(ctx, kind)
	idle := s.settled(ctx)
	s.faultMu.Lock()
	f.End, f.Detail, f.Err, f.Idle = time.Now(), detail, err, idle
	s.faultMu.Unlock()
	if err != nil {
		s.problem(fmt.Sprintf("fault %s: %v", kind, err))
	}
	s.t.Logf("soak %6.1fs: %-27s %s", time.Since(s.started).Seconds(), kind, detail)
}

// hold returns a random duration between lo and hi seconds.
func (s *soak) hold(lo, hi float64) time.Duration {
	return time.Duration((lo + s.rng.Float64()*(hi-lo)) * float64(time.Second))
}

func (s *soak) pause(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

func (s *soak) fault(ctx context.Context, kind string) (string, error) {
	restoreCtx := context.WithoutCancel(ctx)
	switch kind {
	case faultWorkerKill, faultActiveKill:
		i := s.rng.IntN(s.o.Workers)
		var active string
		if kind == faultActiveKill {
			var err error
			if i, active, err = s.activeWorker(ctx); err != nil {
				return "", err
			}
		}
		s.mu.Lock()
		w := s.workers[i]
		s.mu.Unlock()
		if w == nil || w.done() {
			return fmt.Sprintf("worker %d was not running", i), nil
		}
		w.expected.Store(true)
		w.kill()
		down := s.hold(0, 2)
		s.pause(ctx, down)
		s.startWorker(i)
		s.mu.Lock()
		s.restarts++
		s.mu.Unlock()
		return fmt.Sprintf("worker %d (pid %d)%s killed, restarted %.1fs later", i, w.cmd.Process.Pid, active, down.Seconds()), nil

	case faultCloseAll:
		return "rabbitmqctl close_all_connections", s.svc.brokerCloseAll(ctx)

	case faultBrokerStop:
		down := s.hold(2, 6)
		if err := s.svc.brokerStopApp(ctx); err != nil {
			return "", fmt.Errorf("%w (restore: %v)", err, s.svc.brokerStart(restoreCtx))
		}
		s.pause(ctx, down)
		t0 := time.Now()
		err := s.svc.brokerStart(restoreCtx)
		return fmt.Sprintf("rabbitmqctl stop_app, start_app %.1fs later (up in %.1fs)", down.Seconds(), time.Since(t0).Seconds()), err

	case faultPGTerminate:
		n, err := s.svc.pgTerminate(ctx, s.workerPrefix())
		return fmt.Sprintf("pg_terminate_backend of %d worker sessions", n), err

	case faultPGRestart:
		t0 := time.Now()
		err := s.svc.pgRestartFast(restoreCtx)
		if err != nil {
			err = fmt.Errorf("%w (restore: %v)", err, s.svc.pgStart(restoreCtx))
		}
		return fmt.Sprintf("pg_ctlcluster restart -m fast (%.1fs)", time.Since(t0).Seconds()), err

	case faultPGStopImmed:
		down := s.hold(2, 5)
		if err := s.svc.pgStopImmediate(restoreCtx); err != nil {
			return "", fmt.Errorf("%w (restore: %v)", err, s.svc.pgStart(restoreCtx))
		}
		s.pause(ctx, down)
		t0 := time.Now()
		err := s.svc.pgStart(restoreCtx)
		return fmt.Sprintf("pg_ctlcluster stop -m immediate, start %.1fs later (up in %.1fs)", down.Seconds(), time.Since(t0).Seconds()), err

	case faultNetLatency, faultNetBlackhole, faultNetResetPeer:
		proxies := s.o.NetProxies
		if proxies == nil {
			proxies = []string{proxyPostgres, proxyRabbitMQ}
		}
		proxy := proxies[s.rng.IntN(len(proxies))]
		stream := []string{"upstream", "downstream"}[s.rng.IntN(2)]
		tx := toxic{Name: fmt.Sprintf("chaos-%d", time.Now().UnixNano()), Stream: stream, Toxicity: 1}
		var hold time.Duration
		var what string
		switch kind {
		case faultNetLatency:
			ms := 100 + s.rng.IntN(500)
			tx.Type, tx.Attributes = "latency", map[string]any{"latency": ms, "jitter": ms / 4}
			hold, what = s.hold(3, maxFaultHoldSeconds), fmt.Sprintf("latency %dms", ms)
		case faultNetBlackhole:
			// timeout 0: data is dropped until the toxic goes; otherwise
			// the connections are closed after that long without data.
			ms := []int{0, 2000}[s.rng.IntN(2)]
			tx.Type, tx.Attributes = "timeout", map[string]any{"timeout": ms}
			hold, what = s.hold(2, 5), fmt.Sprintf("timeout %dms (black hole)", ms)
		default:
			tx.Type, tx.Attributes = "reset_peer", map[string]any{"timeout": 0}
			hold, what = s.hold(1, 3), "reset_peer"
		}
		if err := s.tp.addToxic(proxy, tx); err != nil {
			return "", err
		}
		s.pause(ctx, hold)
		err := s.tp.removeToxic(proxy, tx.Name)
		if err != nil {
			err = fmt.Errorf("%w (remove all: %v)", err, s.tp.removeAllToxics())
		}
		return fmt.Sprintf("%s on %s %s for %.1fs", what, proxy, stream, hold.Seconds()), err

	case faultPgBouncerRestart:
		if s.bouncer == nil {
			return "", fmt.Errorf("%s: the soak runs no PgBouncer", kind)
		}
		down := s.hold(0.5, 2)
		if err := s.bouncer.kill(); err != nil {
			return "", err
		}
		s.pause(ctx, down)
		t0 := time.Now()
		err := s.bouncer.start(restoreCtx)
		return fmt.Sprintf("PgBouncer SIGKILLed, started again %.1fs later (answers in %.1fs)", down.Seconds(), time.Since(t0).Seconds()), err

	case faultDeleteTier:
		return s.deleteTier(ctx)

	case faultDeleteDLQ:
		return s.deleteDLQ(ctx)

	case faultRabbitLeaderDown:
		return s.svc.cluster.killLeader(restoreCtx, s.insp.work[0])

	case faultRabbitNodeBack:
		return s.svc.cluster.nodeBack(restoreCtx, s.insp.work[0])

	case faultPGFailover:
		return s.svc.cluster.pg.failover(restoreCtx)

	case faultPGRejoin:
		return s.svc.cluster.pg.rejoin(restoreCtx)

	case faultPGSwitchover:
		return s.svc.cluster.pg.switchover(restoreCtx)
	}
	return "", fmt.Errorf("unknown fault %q", kind)
}

// The queue deletions. A deleted queue takes its messages with it: that
// loss would be the fault's, not idemq's, and the soak cannot tell which
// operations it hit. So a queue is deleted only while it is empty and no
// worker can publish into it: the workers are frozen (SIGSTOP), the queue
// drains (a tier's messages expire back into Q; the DLQ's dead letters are
// read out and kept by the soak, counted as in the DLQ at the end), it is
// seen empty three times over half a second (a copy a worker wrote just
// before it froze has landed by then), deleted, and the workers thawed.
// Quorum queues refuse queue.delete with if-empty, so the deletion is
// unconditional; the broker's count of what it took is recorded, and
// anything but 0 fails the run as a loss of the soak's own making. Then,
// with the queue missing, every copy a worker routes to it is returned:
// the delivery must go back to its queue (copy_failed), never be acked.
// The hold lasts until such a failure was seen (or maxFaultHoldSeconds),
// then the queue is declared again as the topology declares it. A worker
// that reconnects meanwhile declares the topology too and brings the queue
// back earlier (the runtime doing its job, noted in the fault's detail); so
// that the copies do meet the missing queue, a deletion waits first until
// every worker consumes again, none in the middle of a reconnect after an
// earlier broker fault.

// deleteTier deletes a retry tier, preferring one that is empty already
// (the workers stay frozen for less time), and declares it again. Half the
// time it is the tier of first retries, the one with steady traffic (every
// flaky op goes through it), so that copies do meet the missing tier; the
// longer tiers see traffic mostly after a Postgres outage.
func (s *soak) deleteTier(ctx context.Context) (string, error) {
	var name string
	var ttl time.Duration
	for try := 0; try < 10; try++ {
		d := s.topo.Delays[0]
		if s.rng.IntN(2) == 0 {
			d = s.topo.Delays[s.rng.IntN(len(s.topo.Delays))]
		}
		name, ttl = s.topo.TierName(d), d
		if n, err := s.insp.depthOf(name); err == nil && n == 0 {
			break
		}
		s.pause(ctx, 200*time.Millisecond)
	}
	short := "Q" + strings.TrimPrefix(name, s.queue)
	s.awaitConsumers(ctx)
	thaw := s.freezeWorkers()
	frozen := time.Now()
	// The tier drains by itself, frozen workers or not: its messages expire.
	if err := s.awaitDrained(ctx, name, ttl+10*time.Second); err != nil {
		thaw()
		return fmt.Sprintf("%s not drained, not deleted", short), err
	}
	return s.deleteAndRedeclare(ctx, name, short, thaw, frozen, "")
}

// deleteDLQ reads the dead letters out of the DLQ (kept as in the DLQ),
// deletes it and declares it again.
func (s *soak) deleteDLQ(ctx context.Context) (string, error) {
	name := s.topo.DLQ
	short := "Q" + strings.TrimPrefix(name, s.queue)
	s.awaitConsumers(ctx)
	thaw := s.freezeWorkers()
	frozen := time.Now()
	movedNow := 0
	for try := 0; ; try++ {
		got, err := s.insp.readAll(name)
		// Even after an error, what was read is kept: an unacked one comes
		// back and counts as an extra copy.
		s.faultMu.Lock()
		s.moved = append(s.moved, got...)
		s.faultMu.Unlock()
		movedNow += len(got)
		if err != nil {
			thaw()
			return fmt.Sprintf("%d dead letters read out, %s not deleted", movedNow, short), err
		}
		// The broker may still dead-letter into it (a delivery limit).
		if s.awaitDrained(ctx, name, 2*time.Second) == nil {
			break
		}
		if try == 5 {
			thaw()
			return fmt.Sprintf("%d dead letters read out, %s not deleted", movedNow, short), fmt.Errorf("%s does not stay empty", name)
		}
	}
	return s.deleteAndRedeclare(ctx, name, short, thaw, frozen, fmt.Sprintf("%d dead letters read out and kept, ", movedNow))
}

// deleteAndRedeclare deletes the drained queue name, thaws the workers,
// holds until a copy failed or maxFaultHoldSeconds, and declares the
// topology again.
func (s *soak) deleteAndRedeclare(ctx context.Context, name, short string, thaw func(), frozen time.Time, prefix string) (string, error) {
	restoreCtx := context.WithoutCancel(ctx)
	taken, err := s.insp.deleteQueue(name)
	thaw()
	frozenFor := time.Since(frozen)
	if err != nil {
		return fmt.Sprintf("%s%s not deleted", prefix, short), fmt.Errorf("%w (redeclare: %v)", err, s.redeclare(restoreCtx))
	}
	deleted := time.Now()
	s.faultMu.Lock()
	s.deleted++
	s.taken += taken
	s.faultMu.Unlock()
	failedBefore := s.copiesFailed(ctx)
	s.pause(ctx, s.hold(2, 3))
	// Awaited, not slept: the hold ends once a copy to the missing queue
	// came back (or at the bound, when none was routed there meanwhile).
	_ = waitUntil(ctx, time.Until(deleted.Add(maxFaultHoldSeconds*time.Second)), func() bool {
		return s.copiesFailed(ctx) > failedBefore
	})
	held := time.Since(deleted)
	_, back, _ := s.insp.consumers(name)
	err = s.redeclare(restoreCtx)
	failed := s.copiesFailed(ctx) - failedBefore
	again := "declared again"
	if back {
		again = "back by itself (a worker reconnected and declared it) before it was declared again"
	}
	detail := fmt.Sprintf("%sdeleted %s (%d messages taken, workers frozen %.1fs), %s %.1fs later; %d copy_failed meanwhile",
		prefix, short, taken, frozenFor.Seconds(), again, held.Seconds(), failed)
	if err == nil && taken > 0 {
		err = fmt.Errorf("deleting %s took %d messages with it", name, taken)
	}
	return detail, err
}

// awaitConsumers waits (at most 30s) until every running worker consumes
// the work queue.
func (s *soak) awaitConsumers(ctx context.Context) {
	_ = waitUntil(ctx, 30*time.Second, func() bool {
		n, _, err := s.insp.consumers(s.topo.Queue)
		return err == nil && n >= s.running()
	})
}

// redeclare declares the consumer's topology again, retrying while the
// broker does not answer.
func (s *soak) redeclare(ctx context.Context) error {
	var last error
	err := waitUntil(ctx, time.Minute, func() bool {
		last = s.insp.declareTopology()
		return last == nil
	})
	if err != nil {
		return fmt.Errorf("declare the topology again: %w (last: %v)", err, last)
	}
	return nil
}

// awaitDrained waits until queue name is seen empty three times in a row,
// 250ms apart.
func (s *soak) awaitDrained(ctx context.Context, name string, timeout time.Duration) error {
	empty := 0
	return waitUntil(ctx, timeout, func() bool {
		n, err := s.insp.depthOf(name)
		if err != nil || n > 0 {
			empty = 0
			return false
		}
		empty++
		return empty >= 3
	})
}

// copiesFailed is the workers' count of copy_failed outcomes so far (best
// effort: flushed four times a second).
func (s *soak) copiesFailed(ctx context.Context) int64 {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var n int64
	_ = s.pool.QueryRow(ctx, `SELECT coalesce(sum(n), 0) FROM `+pgx.Identifier{s.schema}.Sanitize()+`.stats
WHERE outcome = $1 OR starts_with(outcome, $1 || ':')`, "copy_failed").Scan(&n)
	return n
}
