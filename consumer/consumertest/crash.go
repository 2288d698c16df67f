package consumertest

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"text/tabwriter"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/internal/kit"
	"github.com/idemq/idemq/dedup"
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
	// PointAfterReserve: the keys are reserved, their leases held; no
	// handler has run.
	PointAfterReserve = "after the reservation"
	// PointBeforeCommit: the handlers returned, with their effects, and
	// the keys are completed in their transaction, which has not
	// committed.
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
	// ScenarioDuplicateDuring: a second copy of each message arrives, at
	// a second worker, while the first copy's handler runs.
	ScenarioDuplicateDuring = "a second copy during the first"
	// ScenarioDuplicateAfter: a second copy of each message arrives after
	// the first one was handled.
	ScenarioDuplicateAfter = "a second copy after the first"
	// ScenarioLeaseExpired: the first copy's handler is so slow that its
	// lease expires (its worker's heartbeat is off); a second copy, at a
	// second worker, takes the key over and runs; then the slow handler
	// goes on.
	ScenarioLeaseExpired = "the lease expires under a slow handler"
)

// PointInStep names the point inside step name: its function returned
// with its effects, its transaction has not committed.
func PointInStep(name string) string { return "in step " + name + ", before its commit" }

// PointAfterStep names the point after step name committed (with its
// recovery point), before the handler goes on.
func PointAfterStep(name string) string { return "after step " + name + " commits" }

// Mode is how a consumer runs its handlers and holds its keys: one of
// the modes of package consumer (consumer.Mode), the one type the
// consumer's tests, this kit and `idemq bench` run. A crash test runs in
// one mode; Modes lists them all, for a table of tests.
type Mode = consumer.Mode

// The modes the kit runs (see consumer.Modes for the separate ones, which
// it runs too).
const (
	ModeSingle     = consumer.ModeSingle
	ModeGroup      = consumer.ModeGroup
	ModeOptimistic = consumer.ModeOptimistic
	ModeBatch      = consumer.ModeBatch
)

// Modes returns every mode, as consumer.Modes.
func Modes() []Mode { return consumer.Modes() }

// Subject is one fresh copy of what a crash test runs: the store (on a
// schema of its own), the handler and whatever it acts on, and the check
// of the end state. CrashPoints asks its setup for a new Subject for each
// point, so that the effects of one point never reach another's check.
type Subject struct {
	// Store is the key store the handler's keys are claimed in.
	Store *dedup.Store
	// Handler is the handler under test.
	Handler consumer.Handler
	// BatchHandler, when set, is the handler under test instead of
	// Handler, in ModeBatch (consumer.NewBatch). In ModeBatch without it,
	// the batch handler calls Handler on each delivery of the batch in
	// turn, in the batch's transaction.
	BatchHandler consumer.BatchHandler
	// Mode is the mode the consumer runs in, applied to Config
	// (Mode.Apply). Zero: the mode Config and BatchHandler make
	// (consumer.ModeOf).
	Mode Mode
	// Config is the consumer's configuration, as for consumer.New. URL,
	// the broker's (one AMQP URL, or several separated by commas), is
	// required. The crash test gives each point a work
	// queue of its own, named after Queue (default DefaultQueue) and
	// deleted with its tiers and dead-letter queue at the point's end; Name
	// defaults to DefaultName, Lease to CrashLease, a nil Logger logs
	// warnings to the test's log. Each worker runs one executor
	// (Concurrency 1), so that a crash kills all it holds; in the group
	// modes, Group.Size fits all the deliveries and Group.Linger (default
	// 200ms) lets them form one group.
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
	// URL is the broker the relay publishes to (one AMQP URL, or several
	// separated by commas); default the Subject's Config.URL.
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

// CrashPoints publishes deliveries to a real RabbitMQ queue, in order,
// once per crash point, each time on a fresh Subject from setup, has a
// real consumer (consumer.New, or consumer.NewBatch in ModeBatch) of that
// queue take them through its pipeline in the Subject's Mode, and reports
// for each point whether the Subject's Check passed.
//
// At a crash point, the worker that holds a delivery reaching the point
// dies there as a process does: its broker connection drops (the broker
// requeues every delivery it had not acked), the transactions it holds
// open are abandoned (their connections closed without COMMIT or ROLLBACK,
// so Postgres rolls them back), its leases are neither extended nor
// released. A new worker then consumes the queue: the broker redelivers,
// a redelivery that finds its key's lease still valid waits in a retry
// tier, and once the lease expired it takes the key over. Every delivery
// crashes at the point once, the first time it reaches it; in the group
// modes the deliveries that reach it together crash together. When every
// delivery ended (processed, rejected, dead-lettered, a duplicate) and
// the queue and its tiers are empty, Check runs.
//
// The points, in a delivery's order: PointAfterReserve; for every step
// the deliveries ran in the baseline, PointInStep and PointAfterStep;
// PointBeforeCommit; PointAfterCommit. With a Downstream,
// PointOutboxCommitted and PointRelayBeforeMark. Then the scenarios:
// ScenarioDuplicateDuring, ScenarioDuplicateAfter, ScenarioLeaseExpired.
// The first row is the baseline, PointNone.
//
// Each published copy carries the header x-consumertest-copy, and a trace
// context of its own unless it has one: the report names the crashed
// attempts by their traces.
//
// setup is called on the test's goroutine, once per point, before the
// points run; the points then run at the same time (as many as the first
// Subject's pool has room for), so each Subject's handler and Check must
// touch only that Subject's things. CrashPoints fails tb only when it
// cannot run (an invalid configuration, a schema that is not migrated, no
// broker, a delivery that never ends); a failing Check is in the report.
// A point takes a few seconds: each crash waits for a lease to expire.
func CrashPoints(tb testing.TB, setup func(tb testing.TB) Subject, deliveries ...amqp.Publishing) *CrashReport {
	tb.Helper()
	base := setup(tb)
	mode, err := base.mode()
	if err != nil {
		tb.Fatalf("consumertest: CrashPoints: %v", err)
	}
	rep := &CrashReport{Mode: mode}
	var steps []string
	baseline := crashPoint{name: PointNone, watch: func(at kit.At) {
		if at.Stage == kit.StageAfterStep && !slices.Contains(steps, at.Step) {
			steps = append(steps, at.Step)
		}
	}}
	row, err := runPoint(tb, base, deliveries, baseline)
	if err != nil {
		tb.Fatalf("consumertest: CrashPoints %s: %v", PointNone, err)
	}
	rep.Rows = append(rep.Rows, row)
	points := []crashPoint{{name: PointAfterReserve, stage: kit.StageAfterReserve}}
	for _, s := range steps {
		points = append(points,
			crashPoint{name: PointInStep(s), stage: kit.StageInStep, step: s},
			crashPoint{name: PointAfterStep(s), stage: kit.StageAfterStep, step: s})
	}
	points = append(points,
		crashPoint{name: PointBeforeCommit, stage: kit.StageBeforeCommit},
		crashPoint{name: PointAfterCommit, stage: kit.StageAfterCommit})
	if base.Downstream != nil {
		points = append(points,
			crashPoint{name: PointOutboxCommitted, stage: kit.StageAfterCommit, outboxRows: true},
			crashPoint{name: PointRelayBeforeMark, relayCrash: true})
	}
	points = append(points,
		crashPoint{name: ScenarioDuplicateDuring, scenario: duplicateDuring},
		crashPoint{name: ScenarioDuplicateAfter, scenario: duplicateAfter},
		crashPoint{name: ScenarioLeaseExpired, scenario: leaseExpired})
	subjects := make([]Subject, len(points))
	for i := range points {
		subjects[i] = setup(tb)
	}
	rows := make([]CrashRow, len(points))
	errs := make([]error, len(points))
	slots := make(chan struct{}, parallelPoints(base.Store))
	var wg sync.WaitGroup
	for i, p := range points {
		wg.Go(func() {
			slots <- struct{}{}
			defer func() { <-slots }()
			rows[i], errs[i] = runPoint(tb, subjects[i], deliveries, p)
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			tb.Fatalf("consumertest: CrashPoints %s: %v", points[i].name, err)
		}
	}
	rep.Rows = append(rep.Rows, rows...)
	return rep
}

// pointConns is how many database connections one point may hold at once:
// a transaction, a step's, a heartbeat's, a reservation's, for each of two
// workers.
const pointConns = 6

// maxParallelPoints bounds the points that run at once.
const maxParallelPoints = 16

// parallelPoints is how many points run at once on store's pool.
func parallelPoints(store *dedup.Store) int {
	if store == nil {
		return 1
	}
	return min(maxParallelPoints, max(1, int(store.Pool().Config().MaxConns)/pointConns))
}

// mode is the mode the Subject runs in, and whether its handlers fit it.
func (s Subject) mode() (Mode, error) {
	var cfg consumer.Config
	if s.Config != nil {
		cfg = *s.Config
	}
	m := s.Mode
	if m == "" {
		m = consumer.ModeOf(&cfg, s.BatchHandler != nil)
	}
	switch {
	case !m.Valid():
		return "", fmt.Errorf("unknown mode %q", m)
	case s.BatchHandler != nil && !m.Batch():
		return "", fmt.Errorf("the Subject has a BatchHandler, which mode %s does not run", m)
	case s.Handler == nil && s.BatchHandler == nil:
		return "", errors.New("the setup's Subject needs a Handler (or a BatchHandler)")
	}
	return m, nil
}

// CrashReport is what a crash test found, one row per point.
type CrashReport struct {
	// Mode is the mode the consumer ran in.
	Mode Mode
	Rows []CrashRow
}

// CrashRow is one point's result.
type CrashRow struct {
	// Point names the point or scenario (PointAfterReserve, ...).
	Point string
	// Reached reports that at least one delivery reached the point (a
	// handler that never commits never reaches PointAfterCommit); always
	// true for the baseline and ScenarioDuplicateAfter.
	Reached bool
	// Err is the Check's failure; nil when the point passed.
	Err error
	// TraceIDs are the traces of the attempts that crashed (in a scenario,
	// of the first copies), one per delivery.
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
	return fmt.Errorf("crash points failed (mode %s):\n%s", r.Mode, r)
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
	watch    func(at kit.At)
	scenario func(k *pointRun) error
	// outboxRows: the point is reached only when outbox rows are pending
	// at its stage. relayCrash: the deliveries run without a crash, the
	// first relay dies after its confirms.
	outboxRows, relayCrash bool
}
