package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/redact"
)

// Run runs the payments scenario and prints its progress and report to w.
// It returns the report, and an error when the scenario could not run or
// its invariant does not hold (see the package documentation).
//
// In a process started by Run as a worker (WorkerEnv is set), Run instead
// consumes until SIGTERM, SIGINT or the end of ctx, drains, and returns a
// zero Report: `idemq demo` is both the scenario and its workers.
func Run(ctx context.Context, opts Options, w io.Writer) (Report, error) {
	if raw, ok := os.LookupEnv(WorkerEnv); ok {
		return Report{}, runWorker(ctx, raw)
	}
	o := opts.withDefaults()
	if err := o.validate(); err != nil {
		return Report{}, fmt.Errorf("demo: %w", err)
	}
	o.JaegerURL = tracingTarget(ctx, o.JaegerURL)
	r := &runner{o: o, w: w, prog: newProgress(w), started: time.Now()}
	defer r.close()
	return r.run(ctx)
}

// runner is the parent's state during one run.
type runner struct {
	o       Options
	w       io.Writer
	prog    *progress
	started time.Time

	pool   *pgxpool.Pool
	conn   *amqp.Connection
	cfg    *consumer.Config
	topo   consumer.Topology
	insp   *inspector
	plan   plan
	pub    *publisher
	logDir string

	workers  []*workerProc // running, oldest first
	next     int           // index of the next worker
	kills    int
	restarts int
	killNote string
}

// settleStable is how long the counters must stay still, with the queues
// empty and no lease held, before the workers are stopped to check that
// nothing is left (for when a killed worker took some events with it).
const settleStable = time.Second

func (r *runner) run(ctx context.Context) (Report, error) {
	o := r.o
	fmt.Fprintln(r.w, "idemq demo: card payments through RabbitMQ, idempotency keys claimed in Postgres")
	var err error
	if r.pool, err = connectPostgres(ctx, o.PostgresURL, o.ConnectWait); err != nil {
		return Report{}, fmt.Errorf("demo: %w", err)
	}
	if r.conn, err = connectAMQP(ctx, o.AMQPURL, o.ConnectWait); err != nil {
		return Report{}, fmt.Errorf("demo: %w", err)
	}
	if err := resetSchema(ctx, r.pool, o.Schema); err != nil {
		return Report{}, fmt.Errorf("demo: %w", err)
	}
	r.cfg = consumerConfig(o.AMQPURL, o.Queue)
	r.topo = consumer.NewTopology(r.cfg.TopologyConfig())
	if err := resetTopology(r.conn, r.cfg); err != nil {
		return Report{}, fmt.Errorf("demo: %w", err)
	}
	r.insp = newInspector(o.AMQPURL, r.topo)
	if r.logDir = o.LogDir; r.logDir == "" {
		if r.logDir, err = os.MkdirTemp("", "idemq-demo-"); err != nil {
			return Report{}, fmt.Errorf("demo: worker log directory: %w", err)
		}
	} else if err := os.MkdirAll(r.logDir, 0o755); err != nil {
		return Report{}, fmt.Errorf("demo: worker log directory: %w", err)
	}
	r.plan = buildPlan(o.Payments, o.Seed)
	r.printSetup()

	for range o.Workers {
		if err := r.startWorker(); err != nil {
			return Report{}, err
		}
	}
	if err := r.waitConsumers(ctx, o.Workers); err != nil {
		return Report{}, err
	}

	r.pub = newPublisher(r.conn, r.pool, o.Schema, o.Queue)
	pubCtx, stopPub := context.WithCancel(ctx)
	defer stopPub()
	pubDone := make(chan error, 1)
	go func() { pubDone <- r.pub.run(pubCtx, r.plan.Messages) }()

	settleErr := r.settle(ctx, pubDone)
	stopPub()
	r.prog.end()
	if settleErr != nil && !errors.Is(settleErr, errNotSettled) {
		return Report{}, settleErr
	}
	// Graceful drain of the workers still running, before counting.
	r.stopWorkers()
	elapsed := time.Since(r.started)
	rep, err := r.report(ctx)
	if err != nil {
		return rep, fmt.Errorf("demo: report: %w", err)
	}
	rep.Elapsed = elapsed
	if settleErr != nil {
		rep.Failures = append([]string{settleErr.Error()}, rep.Failures...)
	}
	if o.HTTPPayments > 0 && rep.OK() {
		if rep.HTTP, err = r.runHTTP(ctx); err != nil {
			rep.print(r.w)
			return rep, err
		}
		rep.Failures = append(rep.Failures, rep.HTTP.Failures...)
	}
	rep.print(r.w)
	if o.UIListen != "" && ctx.Err() == nil {
		if err := r.serveUI(ctx, rep); err != nil {
			return rep, err
		}
	}
	if !rep.OK() {
		return rep, fmt.Errorf("demo failed: %s", strings.Join(rep.Failures, "; "))
	}
	return rep, nil
}

func (r *runner) printSetup() {
	o, p := r.o, r.plan
	var tiers []string
	for _, d := range r.topo.Delays {
		tiers = append(tiers, d.String())
	}
	fmt.Fprintf(r.w, "  postgres  %s, schema %s (reset)\n", redact.URL(o.PostgresURL), o.Schema)
	fmt.Fprintf(r.w, "  rabbitmq  %s, queue %s, retry tiers %s, max %d attempts, DLQ %s (reset)\n",
		redact.URL(o.AMQPURL), o.Queue, strings.Join(tiers, " "), maxAttempts, r.topo.DLQ)
	fmt.Fprintf(r.w, "  scenario  %d messages: %d payments (%d of them as bursts of %d concurrent copies), "+
		"%d redeliveries, %d key reuses, %d poison, %d without key, %d with an invalid key; seed %d\n",
		p.Total, p.Kinds[kindPayment]+len(p.Bursts), len(p.Bursts), burstSize,
		p.Kinds[kindDuplicate], p.Kinds[kindReuse], p.Kinds[kindPoison], p.Kinds[kindNoKey], p.Kinds[kindBadKey], o.Seed)
	kill := "no worker is killed"
	if o.KillAt > 0 {
		kill = fmt.Sprintf("one is killed with SIGKILL at %.0f%% settled and replaced", o.KillAt*100)
	}
	fmt.Fprintf(r.w, "  workers   %d processes × %d handlers, lease %s; %s\n", o.Workers, o.Concurrency, lease, kill)
	fmt.Fprintf(r.w, "  logs      %s\n", r.logDir)
}

// startWorker starts one more worker process.
func (r *runner) startWorker() error {
	r.next++
	wp, err := startWorker(workerConfig{
		Index: r.next, PostgresURL: r.o.PostgresURL, AMQPURL: r.o.AMQPURL,
		Schema: r.o.Schema, Queue: r.o.Queue, Concurrency: r.o.Concurrency, WatchStdin: true,
	}, r.logDir)
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	r.workers = append(r.workers, wp)
	return nil
}

// checkWorkers fails when a worker exited without being asked to. After an
// interrupt (Ctrl-C reaches the workers too) it reports the interrupt.
func (r *runner) checkWorkers(ctx context.Context) error {
	for _, wp := range r.workers {
		if wp.done() && ctx.Err() != nil {
			return fmt.Errorf("demo: interrupted: %w", ctx.Err())
		}
		if wp.done() && !wp.expected {
			return fmt.Errorf("demo: worker %d (pid %d) exited unexpectedly (%v); its log %s ends with:\n%s",
				wp.index, wp.pid(), wp.err, wp.logPath, wp.logTail(15))
		}
	}
	return nil
}

// waitConsumers waits until n workers consume the work queue.
func (r *runner) waitConsumers(ctx context.Context, n int) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		if err := r.checkWorkers(ctx); err != nil {
			return err
		}
		st, err := r.insp.state()
		if err == nil && st.Consumers >= n {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("demo: %d of %d workers consuming after 30s (err %v); see the logs in %s", st.Consumers, n, err, r.logDir)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("demo: interrupted: %w", ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// kill ends the oldest worker with SIGKILL and starts a replacement.
func (r *runner) kill(settled int) error {
	victim := r.workers[0]
	victim.kill()
	r.workers = r.workers[1:]
	r.kills++
	if err := r.startWorker(); err != nil {
		return err
	}
	r.killNote = fmt.Sprintf("worker %d (pid %d) killed with SIGKILL at %d/%d settled, %s after start; worker %d started in its place",
		victim.index, victim.pid(), settled, r.plan.Total, time.Since(r.started).Round(100*time.Millisecond), r.next)
	r.prog.note("  %s", r.killNote)
	return nil
}

// stopWorkers stops every running worker gracefully (SIGTERM, drain), all at once.
func (r *runner) stopWorkers() {
	var wg sync.WaitGroup
	for _, wp := range r.workers {
		wg.Go(func() {
			if !wp.stop(shutdownTimeout + 5*time.Second) {
				r.prog.note("  worker %d (pid %d) did not stop cleanly: %v; log %s", wp.index, wp.pid(), wp.err, wp.logPath)
			}
		})
	}
	wg.Wait()
	r.workers = nil
}

// counters are what the parent follows during the run.
type counters struct {
	settled  int // deliveries that ended in a final outcome (worker events)
	retried  int
	leases   int // keys held under a valid lease
	queues   queueState
	dbErr    error
	queueErr error
}

// quiet reports that nothing is left to settle: the work queue and the
// retry tiers are empty, no key is leased, and both counts were read.
func (c counters) quiet() bool {
	return c.dbErr == nil && c.queueErr == nil && c.queues.Ready == 0 && c.queues.Retrying == 0 && c.leases == 0
}

var finalOutcomes = []string{
	string(consumer.OutcomeProcessed), string(consumer.OutcomeRejected), string(consumer.OutcomeDuplicate),
	string(consumer.OutcomeDeadLettered), string(consumer.OutcomeKeyReuse), string(consumer.OutcomeInvalidKey),
}

func (r *runner) counters(ctx context.Context) counters {
	var c counters
	s := pgx.Identifier{r.o.Schema}.Sanitize()
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	c.dbErr = r.pool.QueryRow(qctx, `SELECT
    (SELECT count(*) FROM `+s+`.events WHERE outcome = ANY($1)),
    (SELECT count(*) FROM `+s+`.events WHERE outcome = 'retried'),
    (SELECT count(*) FROM `+s+`.keys WHERE state = 'in_progress' AND locked_until > now())`,
		finalOutcomes).Scan(&c.settled, &c.retried, &c.leases)
	c.queues, c.queueErr = r.insp.state()
	return c
}

// settle follows the run until every message has settled, killing a worker
// on the way. Settled means: the publisher is done, the work queue and the
// retry tiers are empty and no key is held under a lease, checked once more
// after the workers stopped (a stopped worker holds no unacked message).
func (r *runner) settle(ctx context.Context, pubDone <-chan error) error {
	o := r.o
	deadline := time.Now().Add(o.Timeout)
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	published := false
	killAt := -1
	if o.KillAt > 0 {
		killAt = int(o.KillAt * float64(r.plan.Total))
	}
	var last counters
	lastChange := time.Now()
	for {
		select {
		case <-ctx.Done():
			return fmt.Errorf("demo: interrupted: %w", ctx.Err())
		case err := <-pubDone:
			if err != nil {
				return fmt.Errorf("demo: %w", err)
			}
			published = true
			pubDone = nil
		case <-tick.C:
		}
		if err := r.checkWorkers(ctx); err != nil {
			return err
		}
		c := r.counters(ctx)
		if c.settled != last.settled || c.retried != last.retried || c.queues != last.queues || c.leases != last.leases {
			lastChange = time.Now()
		}
		last = c
		if killAt >= 0 && r.kills == 0 && c.settled >= killAt {
			if err := r.kill(c.settled); err != nil {
				return err
			}
		}
		r.prog.update(r.status(c), false)

		if published && c.quiet() && (c.settled >= r.plan.Total || time.Since(lastChange) >= settleStable) {
			// Stopping the workers returns whatever they prefetched to the
			// queue: only then is an empty queue proof that all settled.
			r.stopWorkers()
			c = r.counters(ctx)
			if c.quiet() {
				// Every message settled, also those whose events a killed
				// worker took with it: the last line says so, with the
				// final counts.
				c.settled = max(c.settled, r.plan.Total)
				r.prog.update(r.status(c), true)
				r.prog.end()
				return nil
			}
			r.prog.update(r.status(c), true)
			r.restarts++
			r.prog.note("  not settled yet (%d ready, %d retrying, %d keys leased); starting the workers again", c.queues.Ready, c.queues.Retrying, c.leases)
			for range o.Workers {
				if err := r.startWorker(); err != nil {
					return err
				}
			}
			lastChange = time.Now()
		}
		if time.Now().After(deadline) {
			r.prog.update(r.status(c), true)
			r.prog.end()
			return fmt.Errorf("%w within %s: %d/%d settled, %d ready in %s, %d in the retry tiers, %d keys in progress (db: %v, broker: %v)",
				errNotSettled, o.Timeout, c.settled, r.plan.Total, c.queues.Ready, o.Queue, c.queues.Retrying, c.leases, c.dbErr, c.queueErr)
		}
	}
}

func (r *runner) status(c counters) string {
	total := r.plan.Total
	settled := min(c.settled, total)
	line := fmt.Sprintf("%s settled %d/%d · published %d · queued %d · retrying %d · dead letters %d · workers %d · killed %d · %s",
		bar(settled, total), settled, total, r.pub.published.Load(), c.queues.Ready, c.queues.Retrying, c.queues.DLQ,
		len(r.workers), r.kills, time.Since(r.started).Round(time.Second))
	if c.dbErr != nil {
		line += " · postgres: " + redact.Error(c.dbErr)
	}
	if c.queueErr != nil {
		line += " · rabbitmq: " + redact.Error(c.queueErr)
	}
	return line
}

// close stops whatever is still running: workers first, then connections.
func (r *runner) close() {
	if len(r.workers) > 0 {
		r.stopWorkers()
	}
	if r.insp != nil {
		r.insp.close()
	}
	if r.conn != nil {
		_ = r.conn.Close()
	}
	if r.pool != nil {
		r.pool.Close()
	}
}
