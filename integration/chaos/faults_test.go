package chaos

import (
	"context"
	"fmt"
	"time"
)

// The fault kinds, in the order of the report.
const (
	faultWorkerKill     = "worker_sigkill"
	faultCloseAll       = "amqp_close_all_connections"
	faultBrokerStop     = "broker_stop_app"
	faultPGTerminate    = "pg_terminate_backend"
	faultPGRestart      = "pg_restart_fast"
	faultPGStopImmed    = "pg_stop_immediate"
	faultNetLatency     = "net_latency"
	faultNetBlackhole   = "net_timeout"
	faultNetResetPeer   = "net_reset_peer"
	proxyPostgres       = "postgres"
	proxyRabbitMQ       = "rabbitmq"
	maxFaultHoldSeconds = 8
)

var faultKinds = []string{
	faultWorkerKill, faultCloseAll, faultBrokerStop, faultPGTerminate, faultPGRestart,
	faultPGStopImmed, faultNetLatency, faultNetBlackhole, faultNetResetPeer,
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
	var required []string
	if s.o.EveryKind {
		required = append(required, faultKinds...)
		s.rng.Shuffle(len(required), func(i, j int) { required[i], required[j] = required[j], required[i] })
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
		kind := faultKinds[s.rng.IntN(len(faultKinds))]
		if len(required) > 0 {
			kind, required = required[0], required[1:]
		}
		s.inject(ctx, kind)
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
	case faultWorkerKill:
		i := s.rng.IntN(s.o.Workers)
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
		return fmt.Sprintf("worker %d (pid %d) killed, restarted %.1fs later", i, w.cmd.Process.Pid, down.Seconds()), nil

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
		proxy := []string{proxyPostgres, proxyRabbitMQ}[s.rng.IntN(2)]
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
	}
	return "", fmt.Errorf("unknown fault %q", kind)
}
