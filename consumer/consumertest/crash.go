package consumertest

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"text/tabwriter"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/internal/kit"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/relaykit"
	"github.com/idemq/idemq/outbox"
)

// CrashLease is the lease of a crash test's keys unless its Subject's
// Config sets one: the shortest a store accepts, so that a crashed
// attempt's key is taken over within about a second.
const CrashLease = time.Second

// The points and scenarios of a crash test, as its report names them. The
// points inside steps are named by PointInStep and PointAfterStep.
const (
	// PointNone: every delivery runs without a crash (the baseline).
	PointNone = "no crash"
	// PointAfterReserve: the key is reserved, its lease held; the handler
	// has not run.
	PointAfterReserve = "after the reservation"
	// PointBeforeCommit: the handler returned, with its effects, and the
	// key is completed in its transaction, which has not committed.
	PointBeforeCommit = "after the handler, before COMMIT"
	// PointAfterCommit: the transaction committed; the delivery is not
	// acked, so the broker delivers it again.
	PointAfterCommit = "after COMMIT, before the ack"
	// PointOutboxCommitted: the transaction committed with the handler's
	// outbox rows; the worker dies before the ack, and before any relay
	// published them. The delivery comes again (a duplicate, its key
	// completed); a relay started afterwards publishes the rows. Run only
	// when the Subject has a Downstream; reached when rows were pending.
	PointOutboxCommitted = "after an outbox row commits, before the relay publishes"
	// PointRelayBeforeMark: a relay published a batch of the outbox's rows
	// and got the broker's confirms, then dies without marking them; a new
	// relay publishes them again, with the same message ids. Run only when
	// the Subject has a Downstream: there each message arrives twice, so
	// its Check passes only when it deduplicates by message_id.
	PointRelayBeforeMark = "after the relay publishes, before it marks the row"
	// ScenarioDuplicateDuring: a second copy of each message arrives while
	// the first copy's handler runs.
	ScenarioDuplicateDuring = "a second copy during the first"
	// ScenarioDuplicateAfter: a second copy of each message arrives after
	// the first one was handled.
	ScenarioDuplicateAfter = "a second copy after the first"
	// ScenarioLeaseExpired: the first copy's handler is so slow that its
	// lease expires (its heartbeat does not run); a redelivery takes the
	// key over and runs to its end; then the slow handler goes on.
	ScenarioLeaseExpired = "the lease expires under a slow handler"
)

// PointInStep names the point inside step name: its function returned
// with its effects, its transaction has not committed.
func PointInStep(name string) string { return "in step " + name + ", before its commit" }

// PointAfterStep names the point after step name committed (with its
// recovery point), before the handler goes on.
func PointAfterStep(name string) string { return "after step " + name + " commits" }

// Subject is one fresh copy of what a crash test runs: the store (on a
// schema of its own), the handler and whatever it acts on, and the check
// of the end state. CrashPoints asks its setup for a new Subject for each
// point, so that the effects of one point never reach another's check.
type Subject struct {
	// Store is the key store the handler's keys are claimed in.
	Store *dedup.Store
	// Handler is the handler under test.
	Handler consumer.Handler
	// Config is the consumer's configuration, as for NewRunner (nil for
	// defaults); its Lease defaults to CrashLease.
	Config *consumer.Config
	// Check is called once every delivery ran to its end (processed,
	// rejected, dead-lettered, or a duplicate), and the outbox's rows were
	// published when there is a Downstream: its error, if any, is the
	// point's failure ("charged twice").
	Check func(ctx context.Context) error
	// Downstream, when set, is where the messages the Handler writes into
	// the outbox (outbox.Enqueue, in the Store's schema) arrive; it adds
	// the outbox's points, PointOutboxCommitted and PointRelayBeforeMark.
	Downstream *Downstream
}

// Downstream is the far side of a Subject's outbox: once the deliveries
// ended, CrashPoints runs a real outbox relay (outbox.NewRelay) on the
// Store's schema until every row is published, takes the messages that
// arrived in Queue, and gives them to Check.
type Downstream struct {
	// URL is the broker the relay publishes to.
	URL string
	// Queue is where the outbox's messages are routed (by their Exchange
	// and RoutingKey). It must be the Subject's own and empty: the setup
	// declares it (and its binding) for each Subject.
	Queue string
	// Check is called with the messages that arrived in Queue, in their
	// order, once the Subject's Check passed; its error, if any, is the
	// point's failure. A relay that dies after the broker's confirms publishes its
	// rows again (PointRelayBeforeMark): the copies share a MessageId, and
	// a downstream that is not idempotent applies them twice.
	Check func(ctx context.Context, msgs []amqp.Delivery) error
}

// CrashPoints runs deliveries, in order, through the runtime's pipeline
// once per crash point, each time on a fresh Subject from setup, and
// reports for each point whether the Subject's Check passed.
//
// At a crash point, the first attempt of every delivery that reaches the
// point dies there as a process does: the transactions it holds open are
// abandoned (their connections closed without COMMIT or ROLLBACK, so
// Postgres rolls them back), its lease is neither extended nor released,
// and the delivery is not acked. When the lease has expired, the delivery
// comes again, as the broker redelivers it, and takes the key over; from
// there every retry copy is delivered too, until the delivery ends
// (processed, rejected, dead-lettered, a duplicate). Then Check runs.
//
// The points, in a delivery's order: PointAfterReserve; for every step
// the deliveries' first attempts ran in the baseline, PointInStep and
// PointAfterStep;
// PointBeforeCommit; PointAfterCommit. Then the scenarios:
// With a Downstream, PointOutboxCommitted and PointRelayBeforeMark. Then
// the scenarios: ScenarioDuplicateDuring, ScenarioDuplicateAfter,
// ScenarioLeaseExpired. The first row is the baseline, PointNone.
//
// CrashPoints fails tb only when it cannot run (an invalid configuration,
// a schema that is not migrated, a delivery that never ends); a failing
// Check is in the report. It takes a few seconds per point: each crash
// waits for a lease to expire.
func CrashPoints(tb testing.TB, setup func(tb testing.TB) Subject, deliveries ...amqp.Publishing) *CrashReport {
	tb.Helper()
	rep := &CrashReport{}
	var steps []string
	baseline := crashPoint{name: PointNone, at: func(stage kit.Stage, step string) bool {
		if stage == kit.StageAfterStep && !slices.Contains(steps, step) {
			steps = append(steps, step)
		}
		return false
	}}
	var probe Subject
	rep.Rows = append(rep.Rows, runPoint(tb, func(tb testing.TB) Subject {
		probe = setup(tb)
		return probe
	}, deliveries, baseline))
	points := []crashPoint{{name: PointAfterReserve, stage: kit.StageAfterReserve}}
	for _, s := range steps {
		points = append(points,
			crashPoint{name: PointInStep(s), stage: kit.StageInStep, step: s},
			crashPoint{name: PointAfterStep(s), stage: kit.StageAfterStep, step: s})
	}
	points = append(points,
		crashPoint{name: PointBeforeCommit, stage: kit.StageBeforeCommit},
		crashPoint{name: PointAfterCommit, stage: kit.StageAfterCommit})
	if probe.Downstream != nil {
		points = append(points,
			crashPoint{name: PointOutboxCommitted, stage: kit.StageAfterCommit, outboxRows: true},
			crashPoint{name: PointRelayBeforeMark, relayCrash: true})
	}
	points = append(points,
		crashPoint{name: ScenarioDuplicateDuring, scenario: duplicateDuring},
		crashPoint{name: ScenarioDuplicateAfter, scenario: duplicateAfter},
		crashPoint{name: ScenarioLeaseExpired, scenario: leaseExpired})
	for _, p := range points {
		rep.Rows = append(rep.Rows, runPoint(tb, setup, deliveries, p))
	}
	return rep
}

// CrashReport is what a crash test found, one row per point.
type CrashReport struct {
	Rows []CrashRow
}

// CrashRow is one point's result.
type CrashRow struct {
	// Point names the point or scenario (PointAfterReserve, ...).
	Point string
	// Reached reports that at least one delivery reached the point (a
	// handler that never commits never reaches PointAfterCommit); always
	// true for the baseline and the scenarios.
	Reached bool
	// Err is the Check's failure; nil when the point passed.
	Err error
	// TraceIDs are the traces of the attempts that crashed (in a scenario,
	// of the first copies): empty when the consumer's TracerProvider
	// records nothing.
	TraceIDs []string
}

// Failed reports whether any point's Check failed.
func (r *CrashReport) Failed() bool {
	return slices.ContainsFunc(r.Rows, func(row CrashRow) bool { return row.Err != nil })
}

// Row returns the row of point (nil if there is none).
func (r *CrashReport) Row(point string) *CrashRow {
	for i := range r.Rows {
		if r.Rows[i].Point == point {
			return &r.Rows[i]
		}
	}
	return nil
}

// Err returns nil when every point passed, else an error whose text is
// the report's table.
func (r *CrashReport) Err() error {
	if !r.Failed() {
		return nil
	}
	return errors.New("crash points failed:\n" + r.String())
}

// String is the report as a table: point, result (passed, not reached, or
// FAILED with the Check's error), and the traces when there are some.
func (r *CrashReport) String() string {
	traces := slices.ContainsFunc(r.Rows, func(row CrashRow) bool { return len(row.TraceIDs) > 0 })
	var b strings.Builder
	w := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	head := "point\tresult"
	if traces {
		head += "\ttrace"
	}
	fmt.Fprintln(w, head)
	for _, row := range r.Rows {
		result := "passed"
		switch {
		case row.Err != nil:
			result = "FAILED: " + strings.ReplaceAll(row.Err.Error(), "\n", "; ")
		case !row.Reached:
			result = "not reached"
		}
		line := row.Point + "\t" + result
		if traces {
			line += "\t" + cmp.Or(strings.Join(row.TraceIDs, ","), "-")
		}
		fmt.Fprintln(w, line)
	}
	w.Flush()
	return strings.TrimSuffix(b.String(), "\n")
}

// crashPoint is one row to run: a stage to crash at (and the step, for a
// step's stages), a hook that only watches (the baseline), or a scenario.
type crashPoint struct {
	name     string
	stage    kit.Stage
	step     string
	at       func(stage kit.Stage, step string) bool
	scenario func(k *crashRun, msg amqp.Publishing) error
	// outboxRows: the point is reached only when outbox rows are pending
	// at its stage. relayCrash: the deliveries run without a crash, the
	// first relay dies after its confirms.
	outboxRows, relayCrash bool
}

// crashRun is one row's run: a fresh Subject and its runner.
type crashRun struct {
	tb      testing.TB
	subject Subject
	runner  *Runner
	lease   time.Duration
	row     *CrashRow
	// outbox is the Store's outbox when the Subject has a Downstream.
	outbox *outbox.Outbox
}

// crashWait bounds every wait of a crash test beyond the lease: for a
// paused handler, for a lease to expire, for a delivery to end.
const crashWait = time.Minute

// maxRuns bounds the deliveries of one message before CrashPoints gives up
// on it ending.
const maxRuns = 50

// runPoint runs every delivery on a fresh Subject under p and checks.
func runPoint(tb testing.TB, setup func(testing.TB) Subject, deliveries []amqp.Publishing, p crashPoint) CrashRow {
	tb.Helper()
	subject := setup(tb)
	if subject.Store == nil || subject.Handler == nil || subject.Check == nil {
		tb.Fatalf("consumertest: CrashPoints: the setup's Subject needs a Store, a Handler and a Check")
	}
	var cfg consumer.Config
	if subject.Config != nil {
		cfg = *subject.Config
	}
	cfg.Lease = cmp.Or(cfg.Lease, CrashLease)
	row := CrashRow{Point: p.name, Reached: p.stage == 0 && !p.relayCrash}
	k := &crashRun{tb: tb, subject: subject, runner: NewRunner(subject.Store, subject.Handler, &cfg), lease: cfg.Lease, row: &row}
	var ob *outbox.Outbox
	if d := subject.Downstream; d != nil {
		if d.URL == "" || d.Queue == "" || d.Check == nil {
			tb.Fatalf("consumertest: CrashPoints: the Subject's Downstream needs a URL, a Queue and a Check")
		}
		var err error
		if ob, err = outbox.New(subject.Store.Pool(), &outbox.Config{Schema: subject.Store.Config().Schema}); err != nil {
			tb.Fatalf("consumertest: CrashPoints: %v", err)
		}
		k.outbox = ob
	}
	for _, msg := range deliveries {
		run := k.crashOnce
		if p.scenario != nil {
			run = func(msg amqp.Publishing, _ crashPoint) error { return p.scenario(k, msg) }
		}
		if err := run(msg, p); err != nil {
			tb.Fatalf("consumertest: CrashPoints %s, message %q: %v", p.name, msg.MessageId, err)
		}
	}
	var msgs []amqp.Delivery
	if ob != nil {
		var err error
		if msgs, err = k.relay(p.relayCrash); err != nil {
			tb.Fatalf("consumertest: CrashPoints %s: %v", p.name, err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), crashWait)
	defer cancel()
	row.Err = subject.Check(ctx)
	if ob != nil && row.Err == nil {
		row.Err = subject.Downstream.Check(ctx, msgs)
	}
	return row
}

// relay publishes the outbox's rows with a real relay until none is
// pending (the first relay dying after its confirms when crash is set),
// and returns the messages that arrived downstream.
func (k *crashRun) relay(crash bool) ([]amqp.Delivery, error) {
	d := k.subject.Downstream
	if crash {
		died, err := k.runRelay(true)
		if err != nil {
			return nil, err
		}
		k.row.Reached = died
	}
	if _, err := k.runRelay(false); err != nil {
		return nil, err
	}
	conn, err := amqp.Dial(d.URL)
	if err != nil {
		return nil, fmt.Errorf("downstream: dial: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("downstream: channel: %w", err)
	}
	// Every row is marked, so each message was confirmed: it is in the
	// queue already.
	var msgs []amqp.Delivery
	for {
		m, ok, err := ch.Get(d.Queue, true)
		if err != nil {
			return nil, fmt.Errorf("downstream: get from %q: %w", d.Queue, err)
		}
		if !ok {
			return msgs, nil
		}
		msgs = append(msgs, m)
	}
}

// runRelay runs one relay on the Subject's outbox until no row is pending
// or, with crash, until it died after the confirms of its first batch (it
// reports whether it did).
func (k *crashRun) runRelay(crash bool) (died bool, err error) {
	r, err := outbox.NewRelay(k.outbox, k.subject.Downstream.URL, &outbox.RelayConfig{
		ConnectionName: "consumertest-relay", Lanes: 1, PollInterval: 20 * time.Millisecond,
		RetryInitial: 20 * time.Millisecond, Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		return false, fmt.Errorf("relay: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var crashed atomic.Bool
	if crash {
		relaykit.SetAfterConfirm(r, func(context.Context) bool {
			if crashed.Swap(true) {
				return false
			}
			cancel()
			return true
		})
	}
	ran := make(chan error, 1)
	go func() { ran <- r.Run(ctx) }()
	deadline := time.Now().Add(crashWait)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case err := <-ran:
			if crashed.Load() {
				return true, nil
			}
			return false, fmt.Errorf("the relay stopped: %v", err)
		case <-tick.C:
		}
		b, err := k.outbox.Pending(context.Background())
		if err != nil {
			cancel()
			<-ran
			return false, err
		}
		if b.Pending == 0 {
			cancel()
			<-ran
			return crashed.Load(), nil
		}
		if time.Now().After(deadline) {
			cancel()
			<-ran
			return false, fmt.Errorf("%d outbox rows still pending after %s", b.Pending, crashWait)
		}
	}
}

// crashOnce delivers msg until it ends, its first attempt crashing at p.
func (k *crashRun) crashOnce(msg amqp.Publishing, p crashPoint) error {
	crashed := false
	at := func(_ context.Context, stage kit.Stage, step string) bool {
		if p.at != nil {
			return p.at(stage, step)
		}
		if crashed || stage != p.stage || step != p.step {
			return false
		}
		if p.outboxRows {
			b, err := k.outbox.Pending(context.Background())
			if err != nil || b.Pending == 0 {
				return false
			}
		}
		crashed = true
		return true
	}
	a, err := k.runner.attempt(k.tb, msg, attemptOpts{at: at})
	if err != nil {
		return err
	}
	return k.toEnd(msg, a)
}

// toEnd takes a delivery of msg that ran (a) to its end: after a crash,
// msg comes again once the lease expired; after a retry or a busy key, the
// copy the runtime published in its place.
func (k *crashRun) toEnd(msg amqp.Publishing, a attempted) error {
	for runs := 1; ; runs++ {
		if a.run.Crashed {
			k.row.Reached = true
			if a.run.TraceID != "" {
				k.row.TraceIDs = append(k.row.TraceIDs, a.run.TraceID)
			}
		}
		next, done, err := k.next(msg, a)
		if err != nil || done {
			return err
		}
		if runs >= maxRuns {
			return fmt.Errorf("the message did not end after %d deliveries (last outcome %q)", maxRuns, a.Outcome)
		}
		msg = next
		if a, err = k.runner.attempt(k.tb, msg, attemptOpts{}); err != nil {
			return err
		}
	}
}

// next is what the broker delivers after a: nothing (done), msg again (a
// crashed, or its copy could not be published), or the copy that replaced
// it. It waits for the lease to expire when the key is held.
func (k *crashRun) next(msg amqp.Publishing, a attempted) (next amqp.Publishing, done bool, err error) {
	if a.run.Crashed {
		return msg, false, k.leaseExpired(a.run.Claim.Scope)
	}
	switch a.Outcome {
	case consumer.OutcomeProcessed, consumer.OutcomeRejected, consumer.OutcomeDuplicate,
		consumer.OutcomeDeadLettered, consumer.OutcomeInvalidKey, consumer.OutcomeKeyReuse:
		return amqp.Publishing{}, true, nil
	case consumer.OutcomeCopyFailed:
		return msg, false, nil
	}
	if a.Copy == nil {
		return amqp.Publishing{}, false, fmt.Errorf("outcome %q without a copy", a.Outcome)
	}
	if a.Outcome == consumer.OutcomeInProgress {
		err = k.leaseExpired(a.run.Claim.Scope)
	}
	return a.Copy.Publishing, false, err
}

// leaseExpired waits until no one holds scope's key: its lease expired or
// was released, or the key completed.
func (k *crashRun) leaseExpired(scope dedup.Scope) error {
	deadline := time.Now().Add(k.lease + crashWait)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		rec, err := k.subject.Store.Inspect(context.Background(), scope)
		switch {
		case errors.Is(err, dedup.ErrNotFound):
			return nil
		case err != nil:
			return fmt.Errorf("inspect the key: %w", err)
		case rec.State != dedup.StateInProgress || !rec.LeaseValid:
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the key's lease did not expire within %s", k.lease+crashWait)
		}
		<-tick.C
	}
}

// paused is a first copy held after its handler returned, before its key's
// completion, until released.
type paused struct {
	held, release chan struct{}
	done          chan attemptResult
	// scope is the key the held handler holds; set before held closes.
	scope dedup.Scope
}

type attemptResult struct {
	a   attempted
	err error
}

// pause starts a delivery of msg whose handler, once it returned, waits
// for release; it returns when the handler is held, or the delivery ended
// without reaching it.
func (k *crashRun) pause(msg amqp.Publishing, noHeartbeat bool) (*paused, error) {
	p := &paused{held: make(chan struct{}), release: make(chan struct{}), done: make(chan attemptResult, 1)}
	hold := func(d *consumer.Delivery) {
		p.scope = dedup.Scope{Consumer: k.runner.cfg.Name, Tenant: d.Tenant, Key: d.Key}
		close(p.held)
		<-p.release
	}
	go func() {
		a, err := k.runner.attempt(k.tb, msg, attemptOpts{after: hold, noHeartbeat: noHeartbeat})
		p.done <- attemptResult{a, err}
	}()
	select {
	case <-p.held:
		return p, nil
	case r := <-p.done:
		p.done <- r
		return p, nil
	case <-time.After(crashWait):
		close(p.release)
		return nil, fmt.Errorf("the first copy did not reach the end of its handler within %s", crashWait)
	}
}

// end releases the held handler and waits for the first copy's attempt.
func (p *paused) end(k *crashRun) (attempted, error) {
	select {
	case <-p.release:
	default:
		close(p.release)
	}
	r := <-p.done
	if r.err != nil {
		return attempted{}, r.err
	}
	if tid := r.a.TraceID; tid != "" {
		k.row.TraceIDs = append(k.row.TraceIDs, tid)
	}
	return r.a, nil
}

// finish releases the held handler and takes the first copy to its end.
func (p *paused) finish(k *crashRun, msg amqp.Publishing) error {
	a, err := p.end(k)
	if err != nil {
		return err
	}
	return k.toEnd(msg, a)
}

// duplicateDuring delivers a second copy of msg while the first one's
// handler is held, then lets the first go on; both run to their end.
func duplicateDuring(k *crashRun, msg amqp.Publishing) error {
	first, err := k.pause(msg, false)
	if err != nil {
		return err
	}
	second, err := k.runner.attempt(k.tb, msg, attemptOpts{})
	if err != nil {
		first.finish(k, msg) //nolint:errcheck // the second copy's error is the one to report
		return err
	}
	if err := first.finish(k, msg); err != nil {
		return err
	}
	return k.toEnd(msg, second)
}

// duplicateAfter delivers msg to its end, then a second copy.
func duplicateAfter(k *crashRun, msg amqp.Publishing) error {
	for i := range 2 {
		a, err := k.runner.attempt(k.tb, msg, attemptOpts{})
		if err != nil {
			return err
		}
		if i == 0 && a.TraceID != "" {
			k.row.TraceIDs = append(k.row.TraceIDs, a.TraceID)
		}
		if err := k.toEnd(msg, a); err != nil {
			return err
		}
	}
	return nil
}

// leaseExpired holds the first copy's handler, without a heartbeat, until
// its lease expired and a redelivery took the key over and entered its
// handler; then the first goes on (its completion finds the lease lost),
// and both run to their end.
func leaseExpired(k *crashRun, msg amqp.Publishing) error {
	first, err := k.pause(msg, true)
	if err != nil {
		return err
	}
	select {
	case <-first.held:
	default: // the first copy ended without running its handler to its end
		return first.finish(k, msg)
	}
	if err := k.leaseExpired(first.scope); err != nil {
		first.finish(k, msg) //nolint:errcheck // the wait's error is the one to report
		return err
	}
	entered := make(chan struct{})
	var once sync.Once
	second := make(chan attemptResult, 1)
	go func() {
		a, err := k.runner.attempt(k.tb, msg, attemptOpts{before: func(*consumer.Delivery) {
			once.Do(func() { close(entered) })
		}})
		second <- attemptResult{a, err}
	}()
	// The first goes on once the second holds the key and runs (its
	// handler may then wait for rows the first holds), or has ended.
	var r attemptResult
	select {
	case <-entered:
	case r = <-second:
		second <- r
	case <-time.After(crashWait):
	}
	a, err := first.end(k)
	if err != nil {
		return err
	}
	// The second ends first, as it would on a broker: the first's copy
	// waits in its retry tier.
	r = <-second
	if r.err != nil {
		return r.err
	}
	if err := k.toEnd(msg, r.a); err != nil {
		return err
	}
	return k.toEnd(msg, a)
}
