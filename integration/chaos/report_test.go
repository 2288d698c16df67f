package chaos

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/wire"
)

// report is what a soak found, computed at the end from the database and
// the queues (and, best effort, from the workers' outcome counters).
type report struct {
	RunID, Services string
	Seed            uint64
	Started         time.Time
	Elapsed         time.Duration
	Workers, Conc   int

	Planned, Ops, Duplicates, Bursts, Flaky, SharedKeys, HeaderKeys int
	ByKind                                                          map[string]int
	FrameMax                                                        int
	Confirmed, Republished, PublisherReconnects, Returned           int64

	Processed, Rejected, DeadLetteredKeys, Lost int
	Effects, DoubledKeys, StrayEffects          int
	Leased, Released, ReleasedNotPoison         int
	Reservations                                int // sum of attempts: reservations and takeovers

	OutboxRows, OutboxWant, OutboxPending, OutboxParked, OutboxDoubled int
	// ParkedVoid counts the parked rows of unroutable twins (expected),
	// VoidReturns their returns; OutboxParked the other parked rows.
	ParkedVoid, VoidReturns int
	// MarkedUnarrived counts rows marked published whose message is not
	// in the queue their route leads to (none, for an unroutable twin);
	// RoutableReturned rows of a bound route booked as returned (a return
	// matched to the wrong publish, such as the unroutable twin's).
	MarkedUnarrived, RoutableReturned              int
	Forwarded, ForwardedIDs, ForwardCopies         int
	ForwardMissing, ForwardForeign, ForwardCorrupt int
	TwinArrived, TwinCopies, TwinMissing           int
	TwinForeign, VoidNotParked                     int

	// Trimmed counts the near_frame_max ops processed from a trimmed copy,
	// NotTrimmed those processed with their tracestate still on;
	// TooLarge the at_frame_max ops dead-lettered headers_too_large.
	Trimmed, NotTrimmed, TooLarge int

	DLQMessages, DLQKeys, DLQCopies, DLQMissing, DLQUnexpected int
	DLQByReason                                                map[string]int
	DLQNoError                                                 int
	WorkLeft, RetryLeft                                        int
	// Moved counts the dead letters read out of the DLQ before a fault
	// deleted it; QueuesDeleted the deletions, Taken the messages the
	// broker deleted with the queues (0: every deletion found its queue
	// empty).
	Moved, QueuesDeleted, Taken int

	Outcomes       map[string]int64
	WorkerRestarts int
	// Kinds are the fault kinds of the run, Faults what was injected.
	Kinds  []string
	Faults []faultRecord
	// Topology describes the cluster of a cluster run, or the way through
	// PgBouncer ("" otherwise).
	Topology string
	// Ordered is what an ordered soak found (nil for the others).
	Ordered *orderedFindings

	Settled    bool
	PublishErr error
	Failures   []string
}

type scoped struct{ tenant, key string }

// newReport starts the report of a run with what every soak reports: the
// run, the publisher, the faults, the problems seen while running, the
// workers' logs and outcome counters.
func (s *soak) newReport() *report {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	r := &report{
		RunID: s.runID, Services: s.svc.mode, Seed: s.o.Seed, Started: s.started, Elapsed: time.Since(s.started),
		Workers: s.o.Workers, Conc: s.o.Concurrency,
		Planned: s.plan.Total, Ops: len(s.plan.Ops), Duplicates: s.plan.Duplicates, Bursts: s.plan.Bursts,
		Flaky: s.plan.Flaky, SharedKeys: s.plan.SharedKeys, HeaderKeys: s.plan.HeaderKeys, ByKind: s.plan.ByKind,
		FrameMax:  s.plan.FrameMax,
		Confirmed: s.pub.confirmed.Load(), Republished: s.pub.republished.Load(),
		PublisherReconnects: s.pub.reconnects.Load(), Returned: s.pub.returned.Load(),
		DLQByReason: map[string]int{}, Outcomes: map[string]int64{}, Kinds: s.o.kinds(),
	}
	if s.o.Cluster {
		r.Topology = fmt.Sprintf("RabbitMQ %d nodes (%s), quorum queues with a member on each; Postgres %d members under Patroni (%s), synchronous_mode, etcd; workers on %s",
			clusterNodes, strings.Join(s.svc.cluster.nodeNames(), ", "), patroniMembers, strings.Join(s.svc.cluster.pg.names(), ", "),
			"all three AMQP URLs and the three Postgres hosts with target_session_attrs=read-write")
	}
	if s.o.PgBouncer {
		r.Topology = fmt.Sprintf("workers → toxiproxy → PgBouncer (transaction pooling, %s) → Postgres %s; relays LISTEN on direct connections",
			s.bouncer.addr(), s.svc.pg)
	}
	fail := func(format string, args ...any) { r.Failures = append(r.Failures, fmt.Sprintf(format, args...)) }
	s.mu.Lock()
	r.WorkerRestarts = s.restarts
	for _, p := range s.problems {
		fail("%s", p)
	}
	s.mu.Unlock()
	s.faultMu.Lock()
	for _, f := range s.faults {
		r.Faults = append(r.Faults, *f)
	}
	r.Moved, r.QueuesDeleted, r.Taken = len(s.moved), s.deleted, s.taken
	s.faultMu.Unlock()
	if r.Returned > 0 {
		fail("%d publications came back unroutable", r.Returned)
	}
	for _, p := range s.scanLogs() {
		fail("%s", p)
	}
	sch := pgx.Identifier{s.schema}.Sanitize()
	rows, err := s.pool.Query(ctx, `SELECT outcome, sum(n) FROM `+sch+`.stats GROUP BY outcome`)
	if err == nil {
		for rows.Next() {
			var o string
			var n int64
			if rows.Scan(&o, &n) == nil {
				r.Outcomes[o] = n
			}
		}
	}
	return r
}

// verify checks the invariant: each op ended as its kind says (processed
// with exactly one effect and one forwarded message, rejected, or
// dead-lettered), nothing doubled, nothing left.
func (s *soak) verify(ctx context.Context) *report {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Minute)
	defer cancel()
	r := s.newReport()
	fail := func(format string, args ...any) { r.Failures = append(r.Failures, fmt.Sprintf(format, args...)) }
	s.faultMu.Lock()
	moved := slices.Clone(s.moved)
	s.faultMu.Unlock()
	ops := map[scoped]*op{}
	for i := range s.plan.Ops {
		o := &s.plan.Ops[i]
		ops[scoped{o.Tenant, o.Key}] = o
	}
	sch := pgx.Identifier{s.schema}.Sanitize()

	// Keys.
	type keyRow struct {
		state, outcome string
		leased         bool
	}
	keys := map[scoped]keyRow{}
	rows, err := s.pool.Query(ctx, `SELECT tenant, key, state, coalesce(outcome, ''), coalesce(locked_until > now(), false), attempts
FROM `+sch+`.keys WHERE consumer = $1`, consumerName)
	if err != nil {
		fail("read keys: %v", err)
		return r
	}
	for rows.Next() {
		var k scoped
		var kr keyRow
		var attempts int
		if err := rows.Scan(&k.tenant, &k.key, &kr.state, &kr.outcome, &kr.leased, &attempts); err != nil {
			fail("read keys: %v", err)
			return r
		}
		keys[k] = kr
		r.Reservations += attempts
		if kr.leased {
			r.Leased++
		}
		if kr.state == "in_progress" {
			r.Released++
			if o := ops[k]; o == nil || o.deadLetterReason() == "" {
				r.ReleasedNotPoison++
			}
		}
	}
	if rows.Err() != nil {
		fail("read keys: %v", rows.Err())
		return r
	}

	// Effects.
	effects := map[scoped]int{}
	trimmed := map[scoped]bool{}
	rows, err = s.pool.Query(ctx, `SELECT tenant, key, count(*), bool_and(trimmed) FROM `+sch+`.ledger GROUP BY tenant, key`)
	if err != nil {
		fail("read ledger: %v", err)
		return r
	}
	for rows.Next() {
		var k scoped
		var n int
		var trim bool
		if err := rows.Scan(&k.tenant, &k.key, &n, &trim); err != nil {
			fail("read ledger: %v", err)
			return r
		}
		effects[k], trimmed[k] = n, trim
		r.Effects += n
		if n > 1 {
			r.DoubledKeys++
		}
		if o := ops[k]; o == nil || !o.processed() {
			r.StrayEffects += n
		}
	}

	// Outbox rows, by message_id and route: a twin op has two rows of
	// one message_id.
	type outboxRow struct {
		n, returns        int
		published, parked bool
	}
	outboxIDs := map[string]bool{}
	outboxRows := map[[2]string]*outboxRow{}
	rows, err = s.pool.Query(ctx, `SELECT message_id, routing_key, true, false, returns FROM `+sch+`.outbox_published
UNION ALL SELECT message_id, routing_key, published_at IS NOT NULL, parked_at IS NOT NULL, returns FROM `+sch+`.outbox`)
	if err != nil {
		fail("read outbox: %v", err)
		return r
	}
	for rows.Next() {
		var id, route string
		var w outboxRow
		if err := rows.Scan(&id, &route, &w.published, &w.parked, &w.returns); err != nil {
			fail("read outbox: %v", err)
			return r
		}
		r.OutboxRows++
		outboxIDs[id] = true
		if route != routeVoid && w.returns > 0 {
			r.RoutableReturned++
		}
		k := [2]string{id, route}
		if prev := outboxRows[k]; prev != nil {
			prev.n++
			if prev.n == 2 {
				r.OutboxDoubled++
			}
			continue
		}
		w.n = 1
		outboxRows[k] = &w
		switch {
		case !w.published && !w.parked:
			r.OutboxPending++
		case w.parked && route == routeVoid:
			r.ParkedVoid++
			r.VoidReturns += w.returns
		case w.parked:
			r.OutboxParked++
		}
	}

	// The forwarded messages, on the output queue and the twin queue.
	forwarded := map[string]int{}
	out, err := s.insp.readAll(s.outQ)
	if err != nil {
		fail("read output queue: %v", err)
	}
	r.Forwarded = len(out)
	corrupt := func(d amqp.Delivery) bool {
		idx, ok := d.Headers["x-chaos-op"].(int64)
		return !ok || idx < 0 || int(idx) >= len(s.plan.Ops) || !bytes.Equal(s.plan.Ops[idx].Body, d.Body)
	}
	for _, d := range out {
		forwarded[d.MessageId]++
		if corrupt(d) {
			r.ForwardCorrupt++
		}
	}
	r.ForwardedIDs = len(forwarded)
	r.ForwardCopies = r.Forwarded - r.ForwardedIDs
	for id := range forwarded {
		if !outboxIDs[id] {
			r.ForwardForeign++
		}
	}
	twins := map[string]int{}
	twinOut, err := s.insp.readAll(s.twinQ)
	if err != nil {
		fail("read twin queue: %v", err)
	}
	for _, d := range twinOut {
		twins[d.MessageId]++
		if corrupt(d) {
			r.ForwardCorrupt++
		}
	}
	r.TwinArrived = len(twins)
	r.TwinCopies = len(twinOut) - len(twins)
	// A row marked published must have arrived where its route leads.
	arrived := map[string]map[string]int{routeForwarded: forwarded, routeTwin: twins}
	for k, w := range outboxRows {
		if w.published && arrived[k[1]][k[0]] == 0 {
			r.MarkedUnarrived++
		}
	}
	for id := range twins {
		if outboxRows[[2]string{id, routeTwin}] == nil {
			r.TwinForeign++
		}
	}

	// The dead letters.
	dlqKeys := map[scoped]int{}
	dead, err := s.insp.readAll(s.topo.DLQ)
	if err != nil {
		fail("read DLQ: %v", err)
	}
	dead = append(moved, dead...)
	r.DLQMessages = len(dead)
	for _, d := range dead {
		l := wire.ReadLetter(&d)
		reason := l.Label()
		r.DLQByReason[reason]++
		if l.Error == "" {
			r.DLQNoError++
		}
		tenant, _ := wire.ReadTenant(&d, consumer.DefaultTenantHeader, false)
		key, _ := wire.ReadKey(&d, consumer.DefaultKeyHeader)
		k := scoped{tenant, key}
		dlqKeys[k]++
		if o := ops[k]; o == nil || o.deadLetterReason() == "" || reason != o.deadLetterReason() {
			r.DLQUnexpected++
		}
	}
	r.DLQKeys = len(dlqKeys)
	r.DLQCopies = r.DLQMessages - r.DLQKeys

	// Each op against its kind.
	lostExamples := []string{}
	for i := range s.plan.Ops {
		o := &s.plan.Ops[i]
		k := scoped{o.Tenant, o.Key}
		kr := keys[k]
		ok := true
		switch {
		case o.processed():
			ok = kr.state == "completed" && kr.outcome == "ok" && effects[k] == 1
			if ok {
				r.Processed++
			}
			id := o.forwardedID(consumerName)
			r.OutboxWant++
			if outboxRows[[2]string{id, routeForwarded}] == nil || forwarded[id] == 0 {
				r.ForwardMissing++
			}
			switch o.Kind {
			case kindTwin:
				r.OutboxWant++
				if outboxRows[[2]string{id, routeTwin}] == nil || twins[id] == 0 {
					r.TwinMissing++
				}
			case kindTwinVoid:
				r.OutboxWant++
				if w := outboxRows[[2]string{id, routeVoid}]; w == nil || w.published || !w.parked || w.returns == 0 {
					r.VoidNotParked++
				}
			case kindNearFrameMax:
				if effects[k] > 0 && trimmed[k] {
					r.Trimmed++
				} else if effects[k] > 0 {
					r.NotTrimmed++
				}
			}
		case o.Kind == kindReject:
			ok = kr.state == "completed" && kr.outcome == "rejected" && effects[k] == 0
			if ok {
				r.Rejected++
			}
		default:
			ok = kr.state != "completed" && effects[k] == 0 && dlqKeys[k] > 0
			if ok {
				r.DeadLetteredKeys++
				if o.Kind == kindAtFrameMax {
					r.TooLarge++
				}
			}
			if dlqKeys[k] == 0 {
				r.DLQMissing++
			}
		}
		if !ok {
			r.Lost++
			if len(lostExamples) < 5 {
				lostExamples = append(lostExamples, fmt.Sprintf("op %d (%s, tenant %q, key %q): key %s/%s, %d effects, %d dead letters",
					o.Index, o.Kind, o.Tenant, o.Key, kr.state, kr.outcome, effects[k], dlqKeys[k]))
			}
		}
	}

	st, err := s.insp.state()
	if err != nil {
		fail("read queues: %v", err)
	}
	r.WorkLeft, r.RetryLeft = st.Work, st.Retrying

	if r.Lost > 0 {
		fail("%d ops LOST or wrongly settled, e.g. %s", r.Lost, strings.Join(lostExamples, "; "))
	}
	if r.DoubledKeys > 0 {
		fail("%d keys have more than one effect (DOUBLED)", r.DoubledKeys)
	}
	if r.StrayEffects > 0 {
		fail("%d effects belong to no processed op", r.StrayEffects)
	}
	if r.Effects != r.Processed {
		fail("effects %d != processed ops %d", r.Effects, r.Processed)
	}
	if r.Leased > 0 {
		fail("%d keys left in progress under a lease", r.Leased)
	}
	if r.ReleasedNotPoison > 0 {
		fail("%d keys that are not poison were left released, not completed", r.ReleasedNotPoison)
	}
	if r.OutboxPending > 0 || r.OutboxParked > 0 {
		fail("outbox not drained: %d pending, %d parked (not counting the unroutable twins)", r.OutboxPending, r.OutboxParked)
	}
	if r.OutboxRows != r.OutboxWant || r.OutboxDoubled > 0 {
		fail("outbox holds %d rows (%d twice for one message_id and route) for %d expected of the processed ops", r.OutboxRows, r.OutboxDoubled, r.OutboxWant)
	}
	if r.MarkedUnarrived > 0 {
		fail("%d outbox rows marked published whose message never arrived (LOST by the relay)", r.MarkedUnarrived)
	}
	if r.RoutableReturned > 0 {
		fail("%d outbox rows of a bound route were booked as returned", r.RoutableReturned)
	}
	if r.ForwardMissing > 0 || r.ForwardForeign > 0 || r.ForwardCorrupt > 0 {
		fail("output queue: %d forwarded messages missing, %d with an unknown message_id, %d with a wrong body",
			r.ForwardMissing, r.ForwardForeign, r.ForwardCorrupt)
	}
	if r.TwinMissing > 0 || r.TwinForeign > 0 {
		fail("twin queue: %d twins missing, %d unknown", r.TwinMissing, r.TwinForeign)
	}
	if r.VoidNotParked > 0 {
		fail("%d unroutable twins not kept and parked after their returns", r.VoidNotParked)
	}
	if r.NotTrimmed > 0 {
		fail("%d near_frame_max ops were processed with their tracestate: their retry copy was not trimmed (has the consumer's retry budget changed?)", r.NotTrimmed)
	}
	if r.Taken > 0 {
		fail("the faults' queue deletions took %d messages with them: a loss of the soak's own making, not idemq's (the workers were frozen and the queue looked empty)", r.Taken)
	}
	if r.DLQMissing > 0 || r.DLQUnexpected > 0 || r.DLQNoError > 0 {
		fail("DLQ: %d dead-letter ops missing, %d unexpected dead letters (by reason %v), %d without x-idemq-error",
			r.DLQMissing, r.DLQUnexpected, r.DLQByReason, r.DLQNoError)
	}
	if r.WorkLeft > 0 || r.RetryLeft > 0 {
		fail("%d messages left in the work queue, %d in the retry tiers", r.WorkLeft, r.RetryLeft)
	}
	if r.Confirmed < int64(r.Planned) {
		fail("publisher confirmed %d of %d messages (%v)", r.Confirmed, r.Planned, r.PublishErr)
	}
	return r
}

// String prints the report.
func (r *report) String() string {
	var b strings.Builder
	verdict := "PASS: nothing lost, nothing doubled"
	if len(r.Failures) > 0 {
		verdict = fmt.Sprintf("FAIL: %d problem(s)", len(r.Failures))
	}
	p := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	p("idemq chaos soak %s — %s", r.RunID, verdict)
	p("  run          seed %d, %s services, %d worker processes × %d handlers, %s", r.Seed, r.Services, r.Workers, r.Conc, r.Elapsed.Round(time.Second))
	if r.Topology != "" {
		p("  topology     %s", r.Topology)
	}
	if r.Ordered != nil {
		p("  messages     %d planned: %d events (%d entities × %d), %d duplicates (%d bursts of %d), %d flaky events, %d keys in the header",
			r.Planned, r.Ops, r.Ordered.Keys, r.Ordered.Events, r.Duplicates, r.Bursts, burstSize, r.Flaky, r.HeaderKeys)
		p("  published    %d confirmed (%d sent again after a broker fault, %d publisher reconnects, %d returned)",
			r.Confirmed, r.Republished, r.PublisherReconnects, r.Returned)
		r.Ordered.lines(p)
	} else {
		p("  messages     %d planned: %d ops (%d ok, %d reject, %d poison, %d twins, %d near and %d at frame_max), %d duplicates (%d bursts of %d), %d flaky ops, %d keys shared by two tenants, %d keys in the header",
			r.Planned, r.Ops, r.ByKind[kindOK], r.ByKind[kindReject], r.ByKind[kindPoison]+r.ByKind[kindPoisonJSON],
			r.ByKind[kindTwin]+r.ByKind[kindTwinVoid], r.ByKind[kindNearFrameMax], r.ByKind[kindAtFrameMax],
			r.Duplicates, r.Bursts, burstSize, r.Flaky, r.SharedKeys, r.HeaderKeys)
		p("  ops          %d processed, %d rejected, %d dead-lettered, %d LOST", r.Processed, r.Rejected, r.DeadLetteredKeys, r.Lost)
		p("  effects      %d ledger rows for %d processed ops: %d keys DOUBLED, %d stray", r.Effects, r.Processed, r.DoubledKeys, r.StrayEffects)
		p("  keys         %d reservations for %d ops (takeovers and retries), %d in progress under a lease, %d released (dead-lettered)",
			r.Reservations, r.Ops, r.Leased, r.Released)
		p("  outbox       %d rows (%d expected), %d pending, %d parked (+%d unroutable twins), %d marked published but never arrived, %d routable booked returned",
			r.OutboxRows, r.OutboxWant, r.OutboxPending, r.OutboxParked, r.ParkedVoid, r.MarkedUnarrived, r.RoutableReturned)
		p("  forwarded    %d messages, %d distinct message_ids (%d extra copies, same id), %d missing, %d foreign, %d corrupt",
			r.Forwarded, r.ForwardedIDs, r.ForwardCopies, r.ForwardMissing, r.ForwardForeign, r.ForwardCorrupt)
		p("  twins        %d ops with two rows of one message_id: %d routable twins arrived (%d extra copies), %d missing, %d foreign; %d unroutable twins kept pending, then parked (%d returns in all), %d not parked",
			r.ByKind[kindTwin]+r.ByKind[kindTwinVoid], r.TwinArrived, r.TwinCopies, r.TwinMissing, r.TwinForeign,
			r.ParkedVoid, r.VoidReturns, r.VoidNotParked)
		p("  frame_max    %d bytes: %d ops %d bytes under it processed from a trimmed retry copy (%d not trimmed), %d ops at it (%d bytes under) dead-lettered %s",
			r.FrameMax, r.Trimmed, nearFrameMaxMargin, r.NotTrimmed, r.TooLarge, atFrameMaxMargin, consumer.ReasonHeadersTooLarge)
		p("  DLQ          %d messages (%d read out before a DLQ deletion), %d keys (%d extra copies), by reason %v; %d dead-letter ops missing, %d unexpected",
			r.DLQMessages, r.Moved, r.DLQKeys, r.DLQCopies, sortedMap(r.DLQByReason), r.DLQMissing, r.DLQUnexpected)
		p("  queues       %d left in the work queue, %d in the retry tiers", r.WorkLeft, r.RetryLeft)
	}
	p("  outcomes     %s (workers' counters, best effort)", sortedMap(r.Outcomes))
	var copyFailed int64
	for o, n := range r.Outcomes {
		if o == string(consumer.OutcomeCopyFailed) || strings.HasPrefix(o, string(consumer.OutcomeCopyFailed)+":") {
			copyFailed += n
		}
	}
	p("  copies       %d %s (a retry or dead-letter copy not durable: the delivery went back to its queue); %d queues deleted by faults, %d messages taken with them",
		copyFailed, consumer.OutcomeCopyFailed, r.QueuesDeleted, r.Taken)
	p("  workers      %d restarts after SIGKILL", r.WorkerRestarts)

	byKind := map[string][]faultRecord{}
	for _, f := range r.Faults {
		byKind[f.Kind] = append(byKind[f.Kind], f)
	}
	p("  faults       %d injected", len(r.Faults))
	for _, k := range r.Kinds {
		fs := byKind[k]
		if len(fs) == 0 {
			p("    %-27s 0", k)
			continue
		}
		var sum, worst time.Duration
		n := 0
		for _, f := range fs {
			if f.Recovery > 0 {
				sum += f.Recovery
				worst = max(worst, f.Recovery)
				n++
			}
		}
		mean := time.Duration(0)
		if n > 0 {
			mean = sum / time.Duration(n)
		}
		p("    %-27s %3d   recovery mean %5.1fs, max %5.1fs", k, len(fs), mean.Seconds(), worst.Seconds())
	}
	p("  fault log (recovery = from the end of the fault to the next progress)")
	for _, f := range r.Faults {
		rec := fmt.Sprintf("%5.1fs", f.Recovery.Seconds())
		switch {
		case f.Idle:
			rec = " idle"
		case f.Recovery == 0:
			rec = "    -"
		}
		p("    %7.1fs  %-27s recovery %s  %s", f.Start.Sub(r.Started).Seconds(), f.Kind, rec, f.Detail)
	}
	if len(r.Failures) > 0 {
		p("  FAILURES")
		for _, f := range r.Failures {
			p("    - %s", f)
		}
	}
	return b.String()
}

func sortedMap[V int | int64](m map[string]V) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("%s=%d", k, m[k]))
	}
	return "{" + strings.Join(parts, " ") + "}"
}
