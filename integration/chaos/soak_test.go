package chaos

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/amqpdial"
	"github.com/idemq/idemq/internal/testdb"
)

// soakOptions shape one soak run.
type soakOptions struct {
	// Messages is how many messages to publish, duplicates included.
	Messages int
	// Workers is the number of worker processes, Concurrency their handlers each.
	Workers, Concurrency int
	Seed                 uint64
	// PublishRate bounds the publisher (messages per second; 0: as fast as
	// it goes), so that the work spans the faults.
	PublishRate float64
	// FaultGap bounds the random pause between two faults.
	FaultGap [2]time.Duration
	// EveryKind injects each fault kind at least once, in random order,
	// before the kinds are drawn at random.
	EveryKind bool
	// Timeout bounds the whole run; StallTimeout the time without any
	// progress while work remains.
	Timeout, StallTimeout time.Duration
	// LeaseMS is the key lease of the workers: how fast a killed worker's
	// keys are taken over.
	LeaseMS int
	// Cluster runs the soak on the production topology (cluster_test.go):
	// three RabbitMQ nodes and three Postgres members under Patroni,
	// reached directly, no toxiproxy. The workers get every
	// broker address and the multi-host Postgres URL.
	Cluster bool
	// Kinds are the fault kinds drawn (nil: faultKinds); with EveryKind
	// each one is injected Rounds times (at least once) before the draws.
	Kinds  []string
	Rounds int
	// Ordered makes the soak ordered (ordered_test.go): entities whose
	// events must take effect once each and in order, published to a
	// partitioned queue, consumed with ordering on. Messages is unused then.
	Ordered *orderedShape
	// PgBouncer puts a PgBouncer in transaction pooling mode, which the
	// soak runs itself (pgbouncer_test.go), between toxiproxy and Postgres
	// on the workers' way to the database; their relays LISTEN on a direct
	// connection. Not with Cluster.
	PgBouncer bool
	// NetProxies are the proxies the network toxics are drawn among (nil:
	// both, Postgres and RabbitMQ).
	NetProxies []string
}

// consumerName is the scope of the soak's keys.
const consumerName = "chaos-forwarder"

// soak is one run: its services, its schema and queues, its workers.
type soak struct {
	t       *testing.T
	o       soakOptions
	svc     *services
	tp      *toxiproxy
	bouncer *pgBouncer // nil unless o.PgBouncer
	rng     *rand.Rand
	runID   string
	logDir  string
	schema  string
	queue   string
	outX    string
	outQ    string
	twinQ   string
	pool    *pgxpool.Pool
	plan    plan
	topo    consumer.Topology
	workerT workerConfig // template of the workers' configuration

	mu       sync.Mutex
	workers  []*workerProc
	restarts int
	problems []string // failures seen while running (unexpected exits)

	faults   []*faultRecord
	faultMu  sync.Mutex
	pub      *publisher
	insp     *inspector
	lastMove atomic.Int64 // unix nanos of the last progress
	started  time.Time

	// Under faultMu: moved holds the dead letters read out of the DLQ
	// before a fault deleted it (they count as in the DLQ); deleted counts
	// the queues the faults deleted, taken the messages those deletions
	// took with them (0 unless a fault went wrong).
	moved          []amqp.Delivery
	deleted, taken int
}

// runSoak runs the whole soak and fails t on any loss or double.
func runSoak(t *testing.T, o soakOptions) {
	if o.Seed == 0 {
		o.Seed = uint64(time.Now().UnixNano())
	}
	s := &soak{t: t, o: o, rng: rand.New(rand.NewPCG(o.Seed, 7)), runID: testdb.RandomHex(4), started: time.Now()}
	if d, ok := t.Deadline(); ok && time.Until(d)-2*time.Minute < s.o.Timeout {
		// Leave time for the report and the cleanups before go test panics.
		s.o.Timeout = max(time.Until(d)-2*time.Minute, time.Minute)
	}
	frameMax := s.setup()
	ctx, cancel := context.WithTimeout(context.Background(), s.o.Timeout)
	defer cancel()

	if o.Ordered != nil {
		s.plan = buildOrderedPlan(*o.Ordered, o.Seed)
		t.Logf("ordered soak %s: %d entities × %d events over %d partitions, %d messages (%d duplicates, %d bursts of %d, %d flaky events)",
			s.runID, o.Ordered.Keys, o.Ordered.Events, o.Ordered.Partitions, s.plan.Total, s.plan.Duplicates, s.plan.Bursts, burstSize, s.plan.Flaky)
	} else {
		s.plan = buildPlan(o.Messages, o.Seed, frameMax)
	}
	t.Logf("soak %s: seed %d, %d messages (%d ops, %d duplicates, %d bursts of %d), frame_max %d, %d workers × %d, services %s, logs in %s",
		s.runID, o.Seed, s.plan.Total, len(s.plan.Ops), s.plan.Duplicates, s.plan.Bursts, burstSize,
		frameMax, o.Workers, o.Concurrency, s.svc.mode, s.logDir)
	s.lastMove.Store(time.Now().UnixNano())
	for i := range o.Workers {
		s.startWorker(i)
	}
	exchange, routingKey := "", s.queue
	if o.Ordered != nil {
		exchange, routingKey = s.topo.OrderExchange, ""
	}
	s.pub = newPublisher(s.svc.amqpAddrs(t), exchange, routingKey, &s.plan, o.PublishRate)
	pubDone := make(chan error, 1)
	go func() { pubDone <- s.pub.run(ctx) }()
	monCtx, monStop := context.WithCancel(ctx)
	var monWG sync.WaitGroup
	monWG.Go(func() { s.monitor(monCtx) })

	stalled := s.injectFaults(ctx)
	var pubErr error
	if !stalled {
		pubErr = s.waitPublisher(ctx, pubDone)
	}
	settled := !stalled && pubErr == nil && s.drain(ctx)
	monStop()
	monWG.Wait()
	s.stopWorkers()
	if settled {
		// Workers may have held prefetched messages that no queue counter
		// shows; stopped, they returned them. Run again until nothing is left.
		for round := 0; round < 3 && !s.quiet(ctx); round++ {
			t.Logf("soak: messages left after the workers stopped; running them again (round %d)", round+1)
			for i := range o.Workers {
				s.startWorker(i)
			}
			settled = s.drain(ctx)
			s.stopWorkers()
		}
	}

	var rep *report
	if o.Ordered != nil {
		rep = s.verifyOrdered(ctx)
	} else {
		rep = s.verify(ctx)
	}
	rep.Settled = settled
	rep.PublishErr = pubErr
	if !settled {
		rep.Failures = append(rep.Failures, "the run did not settle: "+s.diagnose(ctx))
	}
	text := rep.String()
	t.Log("\n" + text)
	if path := os.Getenv("IDEMQ_CHAOS_REPORT"); path != "" {
		if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
			t.Errorf("write report: %v", err)
		}
	}
	if len(rep.Failures) > 0 {
		s.logTails()
		t.Fatalf("soak failed: %d problem(s), first: %s", len(rep.Failures), rep.Failures[0])
	}
}

// declareTopology declares the soak's queues. A broker that has just
// started, or one loaded by the tests running beside the soak, may refuse a
// quorum queue declaration with a channel crash (541 INTERNAL_ERROR): the
// declaration is idempotent, so it is tried again for a while, and a private
// node that still refuses is restarted as a whole once (a node whose
// application was stopped and started again may refuse at-least-once
// dead-lettering until its VM restarts).
func (s *soak) declareTopology(ctx context.Context, cfg consumer.Config) error {
	try := func() error {
		var err error
		for attempt := 1; attempt <= 5; attempt++ {
			if err = consumer.Apply(ctx, cfg.URL, cfg.TopologyConfig()); err == nil {
				return nil
			}
			s.t.Logf("declare topology, attempt %d: %v", attempt, err)
			select {
			case <-time.After(time.Duration(attempt) * time.Second):
			case <-ctx.Done():
				return errors.Join(err, ctx.Err())
			}
		}
		return err
	}
	err := try()
	if err == nil || s.svc.rabbit == nil || s.svc.rabbit.base == "" {
		return err
	}
	s.t.Logf("declare topology: restarting the soak's RabbitMQ node after: %v", err)
	if rerr := s.svc.brokerRestart(ctx); rerr != nil {
		return errors.Join(err, rerr)
	}
	return try()
}

// setup starts the services and toxiproxy, migrates a fresh schema and
// declares the queues. It returns the frame_max the broker negotiates.
func (s *soak) setup() (frameMax int) {
	t := s.t
	if s.o.Cluster {
		s.svc = newClusterServices(t)
	} else {
		s.svc = newServices(t)
	}
	dir, err := os.MkdirTemp("", "idemq-chaos-"+s.runID+"-")
	if err != nil {
		t.Fatal(err)
	}
	s.logDir = dir
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("soak: logs kept in %s", dir)
			return
		}
		_ = os.RemoveAll(dir)
	})
	// The workers reach the single-node services through toxiproxy, and
	// a cluster directly: all its addresses, to follow it when a node goes.
	workerPG, workerAMQP := s.svc.pgURL, strings.Join(s.svc.amqpURLs, ",")
	var listenURL string
	if !s.o.Cluster {
		s.tp = startToxiproxy(t, dir)
		pgUpstream := s.svc.pgHostPort
		if s.o.PgBouncer {
			// toxiproxy in front of PgBouncer: see pgbouncer_test.go.
			s.bouncer = startPgBouncer(t, s.svc.pgHostPort, dir)
			pgUpstream = s.bouncer.addr()
		}
		workerPG = withHostPort(s.svc.pgURL, s.tp.proxy(t, "postgres", pgUpstream))
		if s.o.PgBouncer {
			// PgBouncer 1.18 keeps no named prepared statement in
			// transaction mode (docs/operations.md, "PgBouncer"). The
			// relays LISTEN straight to Postgres, as idemq's
			// --postgres-direct-url has them do, rather than poll: the
			// probe each LISTEN connection sends through the pool must
			// reach them there (scanLogs fails a run where one did not).
			workerPG = withQuery(workerPG, "default_query_exec_mode", "cache_describe")
			listenURL = s.svc.pgURL
		}
		workerAMQP = withHostPort(s.svc.amqpURL, s.tp.proxy(t, "rabbitmq", s.svc.amqpHostPort))
		t.Cleanup(func() {
			if err := s.tp.removeAllToxics(); err != nil {
				t.Errorf("chaos: remove toxics: %v", err)
			}
		})
	}

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg, err := pgxpool.ParseConfig(s.svc.pgURL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 6
	cfg.ConnConfig.ConnectTimeout = 5 * time.Second
	cfg.ConnConfig.RuntimeParams["application_name"] = "idemq-chaos-" + s.runID + "-soak"
	s.pool, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.pool.Close)
	s.schema = "idemq_chaos_" + s.runID
	if err := schema.Migrate(ctx, s.pool, s.schema); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	sch := pgx.Identifier{s.schema}.Sanitize()
	_, err = s.pool.Exec(ctx, `
-- The effect: one row per processed message. No unique constraint: the key
-- store is what must prevent a double, and the soak counts any.
-- trimmed: a near_frame_max op processed from a copy that dropped its tracestate.
-- n: the order the effects were written in (an ordered soak checks it).
CREATE TABLE `+sch+`.ledger (
    n bigint GENERATED ALWAYS AS IDENTITY,
    tenant text NOT NULL, key text NOT NULL, op integer NOT NULL,
    worker integer NOT NULL, attempt integer NOT NULL, trimmed boolean NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE `+sch+`.stats (
    incarnation text NOT NULL, outcome text NOT NULL, n bigint NOT NULL,
    PRIMARY KEY (incarnation, outcome)
);`)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("soak: schema %s kept", s.schema)
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if _, err := s.pool.Exec(ctx, "DROP SCHEMA "+sch+" CASCADE"); err != nil {
			t.Logf("soak: drop schema: %v", err)
		}
	})

	s.queue = "idemq-chaos." + s.runID
	s.outX, s.outQ, s.twinQ = s.queue+".forwarded", s.queue+".forwarded.q", s.queue+".twin.q"
	s.workerT = workerConfig{
		Name:        consumerName,
		PostgresURL: workerPG,
		ListenURL:   listenURL,
		AMQPURL:     workerAMQP,
		StatsURL:    s.svc.pgURL,
		Schema:      s.schema,
		Queue:       s.queue,
		OutExchange: s.outX,
		Concurrency: s.o.Concurrency,
		LeaseMS:     s.o.LeaseMS,
		MaxAttempts: 12,
	}
	if s.o.Ordered != nil {
		s.workerT.Partitions = s.o.Ordered.Partitions
	}
	ccfg := s.workerT.consumerConfig()
	ccfg.URL = s.svc.amqpURL
	ccfg.ConnectionName = "idemq-chaos-" + s.runID + "-setup"
	s.topo = consumer.NewTopology(ccfg.TopologyConfig())
	declareCtx, cancelDeclare := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancelDeclare()
	if err := s.declareTopology(declareCtx, ccfg); err != nil {
		t.Fatalf("declare topology: %v", err)
	}
	s.insp = newInspector(s.svc.amqpAddrs(t), s.topo, s.outQ, s.twinQ)
	t.Cleanup(s.insp.close)
	if frameMax, err = s.insp.declareOutput(s.outX, s.outQ, s.twinQ); err != nil {
		t.Fatal(err)
	}
	queues, exchanges := s.topo.Names()
	queues = append(queues, s.outQ, s.twinQ)
	exchanges = append(exchanges, s.outX)
	if s.o.Cluster {
		// Every queue the soak counts on lives on the three nodes.
		if err := s.svc.cluster.checkReplicas(ctx, queues); err != nil {
			t.Fatalf("cluster: %v", err)
		}
		t.Logf("cluster: %d quorum queues, each with a member on each of the %d nodes", len(queues), clusterNodes)
	}
	t.Cleanup(func() {
		if t.Failed() {
			return // keep the queues for a look
		}
		if err := s.insp.deleteAll(queues, exchanges); err != nil {
			t.Logf("soak: delete queues: %v", err)
		}
	})
	return frameMax
}

// workerPrefix is the start of every worker's application_name and
// connection name: the filter of pg_terminate_backend.
func (s *soak) workerPrefix() string { return "idemq-chaos-" + s.runID + "-w" }

// startWorker starts worker i (again). Workers differ in how they commit:
// one delivery at a time, group commit with savepoints, a batch handler,
// optimistic groups (the short soak's three workers run the first three).
func (s *soak) startWorker(i int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	wc := s.workerT
	wc.Index = i
	wc.AppName = fmt.Sprintf("%s%d", s.workerPrefix(), i)
	switch {
	case s.o.Ordered != nil:
		// Ordering takes no batch handler: the ordered soak's workers
		// take turns among the other three.
		wc.GroupSize, wc.Optimistic = []int{1, 8, 8}[i%3], i%3 == 2
	case i%4 == 0:
		wc.GroupSize = 1
	case i%4 == 1:
		wc.GroupSize = 8
	case i%4 == 2:
		wc.GroupSize, wc.Batch = 16, true
	case i%4 == 3:
		wc.GroupSize, wc.Optimistic = 8, true
	}
	for len(s.workers) <= i {
		s.workers = append(s.workers, nil)
	}
	if old := s.workers[i]; old != nil {
		wc.Incarnation = old.cfg.Incarnation + 1
		if !old.done() {
			return
		}
	}
	w, err := startWorker(wc, s.logDir)
	if err != nil {
		s.t.Fatalf("soak: %v", err)
	}
	s.workers[i] = w
}

// running is the number of worker processes running.
func (s *soak) running() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, w := range s.workers {
		if w != nil && !w.done() {
			n++
		}
	}
	return n
}

// freezeWorkers stops every running worker process (SIGSTOP) and returns
// the function that lets them go on. Frozen, the workers publish nothing:
// what a queue holds can only shrink.
func (s *soak) freezeWorkers() (thaw func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var frozen []*workerProc
	for _, w := range s.workers {
		if w != nil && w.freeze() {
			frozen = append(frozen, w)
		}
	}
	return func() {
		for _, w := range frozen {
			w.thaw()
		}
	}
}

// stopWorkers drains and stops every worker.
func (s *soak) stopWorkers() {
	s.mu.Lock()
	ws := append([]*workerProc(nil), s.workers...)
	s.mu.Unlock()
	var wg sync.WaitGroup
	for _, w := range ws {
		if w == nil || w.done() {
			continue
		}
		wg.Go(func() {
			if !w.stop(60 * time.Second) {
				s.problem(fmt.Sprintf("worker %d.%d did not stop cleanly on SIGTERM: %v", w.cfg.Index, w.cfg.Incarnation, w.err))
			}
		})
	}
	wg.Wait()
}

func (s *soak) problem(p string) {
	s.mu.Lock()
	s.problems = append(s.problems, p)
	s.mu.Unlock()
	s.t.Logf("soak: PROBLEM: %s", p)
}

// watchWorkers restarts workers that exited without the soak asking them
// to, and records that as a problem.
func (s *soak) watchWorkers() {
	s.mu.Lock()
	var dead []int
	for i, w := range s.workers {
		if w != nil && w.done() && !w.expected.Load() {
			w.expected.Store(true)
			dead = append(dead, i)
			s.problems = append(s.problems, fmt.Sprintf("worker %d.%d exited by itself (%v); log:\n%s",
				i, w.cfg.Incarnation, w.err, tail(w.logPath, 15)))
		}
	}
	s.mu.Unlock()
	for _, i := range dead {
		s.startWorker(i)
	}
}

// monitor follows the progress every 500ms: it feeds the stall detector and
// the recovery times of the faults, and restarts workers that died.
func (s *soak) monitor(ctx context.Context) {
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	lastAny, lastWork := int64(-1), int64(-1)
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		s.watchWorkers()
		p, ok := s.progress(ctx)
		if !ok {
			continue
		}
		now := time.Now()
		if p.any != lastAny {
			lastAny = p.any
			s.lastMove.Store(now.UnixNano())
		}
		if p.work != lastWork {
			if lastWork >= 0 {
				s.faultMu.Lock()
				for _, f := range s.faults {
					if !f.End.IsZero() && f.Recovery == 0 && !f.Idle && now.After(f.End) {
						f.Recovery = now.Sub(f.End)
					}
				}
				s.faultMu.Unlock()
			}
			lastWork = p.work
		}
	}
}

// progressSignals are sums that move when the soak makes progress. work
// moves only with the workers' own progress (keys completed, rows relayed,
// dead letters, deliveries settled): the recovery after a fault. any moves
// also with the publisher: the stall detector.
type progressSignals struct{ work, any int64 }

func (s *soak) progress(ctx context.Context) (progressSignals, bool) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	sch := pgx.Identifier{s.schema}.Sanitize()
	var completed, relayed, settled int64
	err := s.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+sch+`.keys WHERE state = 'completed'),
       (SELECT count(*) FROM `+sch+`.outbox_published) + (SELECT count(*) FROM `+sch+`.outbox WHERE published_at IS NOT NULL OR parked_at IS NOT NULL),
       (SELECT coalesce(sum(n), 0) FROM `+sch+`.stats WHERE outcome IN ('processed', 'rejected', 'duplicate') OR outcome LIKE 'dead_lettered%')`,
	).Scan(&completed, &relayed, &settled)
	if err != nil {
		return progressSignals{}, false
	}
	st, err := s.insp.state()
	if err != nil {
		return progressSignals{}, false
	}
	work := completed + relayed + settled + int64(st.DLQ+s.movedDeadLetters())
	// Queue depths move both ways; weighted so that moves do not cancel out.
	return progressSignals{work: work, any: work*7 + int64(st.Work+st.Retrying)*11 + s.pub.confirmed.Load()*13}, true
}

func (s *soak) stalledFor() time.Duration {
	return time.Since(time.Unix(0, s.lastMove.Load()))
}

// waitPublisher waits for the publisher to confirm everything.
func (s *soak) waitPublisher(ctx context.Context, done <-chan error) error {
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("publisher not done: %w", ctx.Err())
	}
}

// settled reports whether every op reached its end and nothing is left to
// do: all completions, all dead letters in the DLQ, empty work queue and
// tiers, drained outbox (every row published, but the unroutable twins,
// which must be parked).
func (s *soak) settled(ctx context.Context) bool {
	if !s.pub.finished.Load() {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	sch := pgx.Identifier{s.schema}.Sanitize()
	var completed, pending, parked, leased int
	err := s.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+sch+`.keys WHERE state = 'completed'),
       (SELECT count(*) FROM `+sch+`.outbox WHERE published_at IS NULL AND parked_at IS NULL),
       (SELECT count(*) FROM `+sch+`.outbox WHERE parked_at IS NOT NULL),
       (SELECT count(*) FROM `+sch+`.keys WHERE state = 'in_progress' AND locked_until > now())`).Scan(&completed, &pending, &parked, &leased)
	if err != nil || completed < s.plan.completedWant() || pending > 0 || parked < s.plan.ByKind[kindTwinVoid] || leased > 0 {
		return false
	}
	st, err := s.insp.state()
	return err == nil && st.Work == 0 && st.Retrying == 0 && st.DLQ+s.movedDeadLetters() >= s.plan.deadLetterWant() &&
		st.Output >= s.plan.processedWant() && st.Twin >= s.plan.ByKind[kindTwin]
}

// movedDeadLetters is how many dead letters were read out of the DLQ
// before a fault deleted it.
func (s *soak) movedDeadLetters() int {
	s.faultMu.Lock()
	defer s.faultMu.Unlock()
	return len(s.moved)
}

// quiet reports, with the workers stopped, whether the queues are empty and
// no key is leased.
func (s *soak) quiet(ctx context.Context) bool {
	var ok bool
	_ = waitUntil(ctx, 30*time.Second, func() bool {
		st, err := s.insp.state()
		ok = err == nil && st.Work == 0 && st.Retrying == 0
		return err == nil
	})
	return ok
}

// drain waits until the run settled, or stalls, or the time is up.
func (s *soak) drain(ctx context.Context) bool {
	s.lastMove.Store(time.Now().UnixNano())
	for {
		if s.settled(ctx) {
			return true
		}
		if s.stalledFor() > s.o.StallTimeout {
			s.problem(fmt.Sprintf("no progress for %s: %s", s.o.StallTimeout, s.diagnose(ctx)))
			return false
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(time.Second):
		}
		s.watchWorkers()
	}
}

// diagnose says what is left, for failure messages.
func (s *soak) diagnose(ctx context.Context) string {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	sch := pgx.Identifier{s.schema}.Sanitize()
	var completed, pending, parked, leased, released int
	err := s.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+sch+`.keys WHERE state = 'completed'),
       (SELECT count(*) FROM `+sch+`.outbox WHERE published_at IS NULL AND parked_at IS NULL),
       (SELECT count(*) FROM `+sch+`.outbox WHERE parked_at IS NOT NULL),
       (SELECT count(*) FROM `+sch+`.keys WHERE state = 'in_progress' AND locked_until > now()),
       (SELECT count(*) FROM `+sch+`.keys WHERE state = 'in_progress' AND locked_until <= now())`).Scan(&completed, &pending, &parked, &leased, &released)
	st, qerr := s.insp.state()
	return fmt.Sprintf("published %d/%d (done %v); keys completed %d of %d, leased %d, released %d; outbox pending %d, parked %d of %d; queues %+v, %d dead letters moved (db err %v, broker err %v)",
		s.pub.confirmed.Load(), s.plan.Total, s.pub.finished.Load(), completed, s.plan.completedWant(),
		leased, released, pending, parked, s.plan.ByKind[kindTwinVoid], st, s.movedDeadLetters(), err, qerr)
}

// logTails prints the end of every worker log, for a failed run.
func (s *soak) logTails() {
	files, _ := filepath.Glob(filepath.Join(s.logDir, "*.log"))
	for _, f := range files {
		s.t.Logf("---- %s ----\n%s", filepath.Base(f), tail(f, 25))
	}
}

func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	return lastLines(string(b), n)
}

// scanLogs looks for data races and panics in the worker logs.
func (s *soak) scanLogs() []string {
	var out []string
	files, _ := filepath.Glob(filepath.Join(s.logDir, "worker-*.log"))
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		text := string(b)
		for _, bad := range []string{"WARNING: DATA RACE", "panic:", "fatal error:"} {
			if strings.Contains(text, bad) {
				out = append(out, fmt.Sprintf("%s in %s", strings.TrimSuffix(bad, ":"), filepath.Base(f)))
			}
		}
		if s.workerT.ListenURL != "" && strings.Contains(text, relayDeaf) {
			out = append(out, fmt.Sprintf("a relay's direct LISTEN connection did not hear its probe sent through the pool, and polled, in %s", filepath.Base(f)))
		}
		// The workers are stopped once everything settled: nothing may
		// still be in flight then, unless a delivery was stuck.
		if strings.Contains(text, "shutdown timeout") {
			out = append(out, fmt.Sprintf("a delivery was still in flight at the final stop (stuck) in %s", filepath.Base(f)))
		}
	}
	return out
}

// ---------------------------------------------------------------- broker side

// inspector reads queue depths and contents on a connection of its own,
// dialled again (to another node of a cluster) when a fault closed it.
type inspector struct {
	addrs amqpdial.Addrs
	topo  consumer.Topology
	outQ  string
	twinQ string
	mu    sync.Mutex
	conn  *amqp.Connection
	ch    *amqp.Channel
	// work, tiers and dlqs are the work queues, retry tiers and DLQs: the
	// topology's own, or each partition's of a partitioned one.
	work, tiers, dlqs []string
}

// queueState is a snapshot of the soak's queues (ready messages).
type queueState struct {
	Work, Retrying, DLQ, Output, Twin int
}

func newInspector(addrs amqpdial.Addrs, topo consumer.Topology, outQ, twinQ string) *inspector {
	in := &inspector{addrs: addrs, topo: topo, outQ: outQ, twinQ: twinQ}
	parts := topo.Partitions
	if len(parts) == 0 {
		parts = []consumer.Topology{topo}
	}
	for _, p := range parts {
		in.work, in.dlqs = append(in.work, p.Queue), append(in.dlqs, p.DLQ)
		for _, d := range p.Delays {
			in.tiers = append(in.tiers, p.TierName(d))
		}
	}
	return in
}

func (in *inspector) channel() (*amqp.Channel, error) {
	if in.conn == nil || in.conn.IsClosed() {
		d := amqpdial.Dialer{Addrs: in.addrs, Name: "idemq-chaos-inspector", Timeout: 5 * time.Second}
		conn, err := d.Dial(context.Background())
		if err != nil {
			return nil, err
		}
		in.conn, in.ch = conn, nil
	}
	if in.ch == nil || in.ch.IsClosed() {
		ch, err := in.conn.Channel()
		if err != nil {
			return nil, err
		}
		in.ch = ch
	}
	return in.ch, nil
}

func (in *inspector) close() {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.conn != nil {
		_ = in.conn.Close()
	}
}

func (in *inspector) depth(ch *amqp.Channel, name string) (int, error) {
	q, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
	if err != nil {
		return 0, fmt.Errorf("inspect %s: %w", name, err)
	}
	return q.Messages, nil
}

func (in *inspector) state() (queueState, error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	var st queueState
	ch, err := in.channel()
	if err != nil {
		return st, err
	}
	sum := func(names []string) (int, error) {
		total := 0
		for _, name := range names {
			n, err := in.depth(ch, name)
			if err != nil {
				return 0, err
			}
			total += n
		}
		return total, nil
	}
	if st.Work, err = sum(in.work); err != nil {
		return st, err
	}
	if st.Retrying, err = sum(in.tiers); err != nil {
		return st, err
	}
	if st.DLQ, err = sum(in.dlqs); err != nil {
		return st, err
	}
	if st.Output, err = in.depth(ch, in.outQ); err != nil {
		return st, err
	}
	if st.Twin, err = in.depth(ch, in.twinQ); err != nil {
		return st, err
	}
	return st, nil
}

// depthOf is the number of ready messages in queue name.
func (in *inspector) depthOf(name string) (int, error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	ch, err := in.channel()
	if err != nil {
		return 0, err
	}
	return in.depth(ch, name)
}

// consumers is the number of consumers of queue name, and whether it
// exists at all.
func (in *inspector) consumers(name string) (n int, exists bool, err error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	ch, err := in.channel()
	if err != nil {
		return 0, false, err
	}
	q, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
	var amqpErr *amqp.Error
	if errors.As(err, &amqpErr) && amqpErr.Code == amqp.NotFound {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("inspect %s: %w", name, err)
	}
	return q.Consumers, true, nil
}

// deleteQueue deletes queue name whatever it holds (quorum queues refuse
// if-empty) and returns how many messages went with it.
func (in *inspector) deleteQueue(name string) (int, error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	ch, err := in.channel()
	if err != nil {
		return 0, err
	}
	n, err := ch.QueueDelete(name, false, false, false)
	if err != nil {
		return 0, fmt.Errorf("delete %s: %w", name, err)
	}
	return n, nil
}

// declareTopology declares the consumer's whole topology again, as the
// workers do (Topology.Declare, idempotent).
func (in *inspector) declareTopology() error {
	in.mu.Lock()
	defer in.mu.Unlock()
	ch, err := in.channel()
	if err != nil {
		return err
	}
	return in.topo.Declare(ch)
}

// declareOutput declares the exchange the workers forward to, the output
// queue bound to it with routeForwarded and the twin queue with routeTwin,
// quorum queues like the others (routeVoid is bound to nothing). It
// returns the frame_max its connection negotiated.
func (in *inspector) declareOutput(exchange, queue, twinQueue string) (frameMax int, err error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	ch, err := in.channel()
	if err != nil {
		return 0, err
	}
	if err := ch.ExchangeDeclare(exchange, amqp.ExchangeDirect, true, false, false, false, nil); err != nil {
		return 0, err
	}
	for q, key := range map[string]string{queue: routeForwarded, twinQueue: routeTwin} {
		if _, err := ch.QueueDeclare(q, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
			return 0, err
		}
		if err := ch.QueueBind(q, key, exchange, false, nil); err != nil {
			return 0, err
		}
	}
	return in.conn.Config.FrameSize, nil
}

func (in *inspector) deleteAll(queues, exchanges []string) error {
	in.mu.Lock()
	defer in.mu.Unlock()
	ch, err := in.channel()
	if err != nil {
		return err
	}
	for _, q := range queues {
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			return err
		}
	}
	for _, x := range exchanges {
		if err := ch.ExchangeDelete(x, false, false); err != nil {
			return err
		}
	}
	return nil
}

// readAll consumes every message of queue (nothing else publishes to it
// any more) and returns them. The queue is left empty.
func (in *inspector) readAll(queue string) ([]amqp.Delivery, error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	ctl, err := in.channel()
	if err != nil {
		return nil, err
	}
	want, err := in.depth(ctl, queue)
	if err != nil {
		return nil, err
	}
	ch, err := in.conn.Channel()
	if err != nil {
		return nil, err
	}
	defer ch.Close()
	// Quorum queues cap an unlimited prefetch: ack as the messages come.
	if err := ch.Qos(1000, 0, false); err != nil {
		return nil, err
	}
	deliveries, err := ch.Consume(queue, "", false, true, false, false, nil)
	if err != nil {
		return nil, err
	}
	var out []amqp.Delivery
	for len(out) < want {
		select {
		case d, ok := <-deliveries:
			if !ok {
				return out, fmt.Errorf("read %s: channel closed after %d of %d", queue, len(out), want)
			}
			out = append(out, d)
			if len(out)%200 == 0 || len(out) == want {
				if err := d.Ack(true); err != nil {
					return out, err
				}
			}
		case <-time.After(30 * time.Second):
			return out, fmt.Errorf("read %s: %d of %d after 30s without a message", queue, len(out), want)
		}
	}
	return out, nil
}
