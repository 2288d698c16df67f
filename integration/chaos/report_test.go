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
	"github.com/idemq/idemq/outbox"
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
	Confirmed, Republished, PublisherReconnects, Returned           int64

	Processed, Rejected, DeadLetteredKeys, Lost int
	Effects, DoubledKeys, StrayEffects          int
	Leased, Released, ReleasedNotPoison         int
	Reservations                                int // sum of attempts: reservations and takeovers

	OutboxRows, OutboxPending, OutboxParked, OutboxDoubled int
	Forwarded, ForwardedIDs, ForwardCopies                 int
	ForwardMissing, ForwardForeign, ForwardCorrupt         int

	DLQMessages, DLQKeys, DLQCopies, DLQMissing, DLQUnexpected int
	DLQByReason                                                map[string]int
	DLQNoError                                                 int
	WorkLeft, RetryLeft                                        int

	Outcomes       map[string]int64
	WorkerRestarts int
	Faults         []faultRecord

	Settled    bool
	PublishErr error
	Failures   []string
}

type scoped struct{ tenant, key string }

// verify checks the invariant: each op ended as its kind says (processed
// with exactly one effect and one forwarded message, rejected, or
// dead-lettered), nothing doubled, nothing left.
func (s *soak) verify(ctx context.Context) *report {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Minute)
	defer cancel()
	r := &report{
		RunID: s.runID, Services: s.svc.mode, Seed: s.o.Seed, Started: s.started, Elapsed: time.Since(s.started),
		Workers: s.o.Workers, Conc: s.o.Concurrency,
		Planned: s.plan.Total, Ops: len(s.plan.Ops), Duplicates: s.plan.Duplicates, Bursts: s.plan.Bursts,
		Flaky: s.plan.Flaky, SharedKeys: s.plan.SharedKeys, HeaderKeys: s.plan.HeaderKeys, ByKind: s.plan.ByKind,
		Confirmed: s.pub.confirmed.Load(), Republished: s.pub.republished.Load(),
		PublisherReconnects: s.pub.reconnects.Load(), Returned: s.pub.returned.Load(),
		DLQByReason: map[string]int{}, Outcomes: map[string]int64{},
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
	s.faultMu.Unlock()
	if r.Returned > 0 {
		fail("%d publications came back unroutable", r.Returned)
	}
	for _, p := range s.scanLogs() {
		fail("%s", p)
	}

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
			if o := ops[k]; o == nil || !o.poison() {
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
	rows, err = s.pool.Query(ctx, `SELECT tenant, key, count(*) FROM `+sch+`.ledger GROUP BY tenant, key`)
	if err != nil {
		fail("read ledger: %v", err)
		return r
	}
	for rows.Next() {
		var k scoped
		var n int
		if err := rows.Scan(&k.tenant, &k.key, &n); err != nil {
			fail("read ledger: %v", err)
			return r
		}
		effects[k] = n
		r.Effects += n
		if n > 1 {
			r.DoubledKeys++
		}
		if o := ops[k]; o == nil || o.Kind != kindOK {
			r.StrayEffects += n
		}
	}

	// Outbox rows.
	outboxIDs := map[string]int{}
	rows, err = s.pool.Query(ctx, `SELECT message_id, published_at IS NULL, parked_at IS NOT NULL FROM `+sch+`.outbox`)
	if err != nil {
		fail("read outbox: %v", err)
		return r
	}
	for rows.Next() {
		var id string
		var pending, parked bool
		if err := rows.Scan(&id, &pending, &parked); err != nil {
			fail("read outbox: %v", err)
			return r
		}
		r.OutboxRows++
		outboxIDs[id]++
		if outboxIDs[id] == 2 {
			r.OutboxDoubled++
		}
		if pending {
			r.OutboxPending++
		}
		if parked {
			r.OutboxParked++
		}
	}

	// The forwarded messages.
	forwarded := map[string]int{}
	out, err := s.insp.readAll(s.outQ)
	if err != nil {
		fail("read output queue: %v", err)
	}
	r.Forwarded = len(out)
	for _, d := range out {
		forwarded[d.MessageId]++
		idx, ok := d.Headers["x-chaos-op"].(int64)
		if !ok || idx < 0 || int(idx) >= len(s.plan.Ops) || !bytes.Equal(s.plan.Ops[idx].Body, d.Body) {
			r.ForwardCorrupt++
		}
	}
	r.ForwardedIDs = len(forwarded)
	r.ForwardCopies = r.Forwarded - r.ForwardedIDs
	for id := range forwarded {
		if outboxIDs[id] == 0 {
			r.ForwardForeign++
		}
	}

	// The dead letters.
	dlqKeys := map[scoped]int{}
	dead, err := s.insp.readAll(s.topo.DLQ)
	if err != nil {
		fail("read DLQ: %v", err)
	}
	r.DLQMessages = len(dead)
	for _, d := range dead {
		reason := deadLetterReason(d.Headers)
		r.DLQByReason[reason]++
		if e, _ := d.Headers[consumer.HeaderError].(string); e == "" {
			r.DLQNoError++
		}
		tenant, _ := consumer.ExtractTenant(&d, consumer.DefaultTenantHeader, false)
		key, _ := consumer.ExtractKey(&d, nil, consumer.DefaultKeyHeader)
		k := scoped{tenant, key}
		dlqKeys[k]++
		if o := ops[k]; o == nil || !o.poison() || reason != consumer.ReasonPermanentError {
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
		switch o.Kind {
		case kindOK:
			id := outbox.MessageID(outbox.Claim{Consumer: consumerName, Tenant: o.Tenant, Key: o.Key}, 1)
			ok = kr.state == "completed" && kr.outcome == "ok" && effects[k] == 1
			if ok {
				r.Processed++
			}
			if outboxIDs[id] == 0 || forwarded[id] == 0 {
				r.ForwardMissing++
			}
		case kindReject:
			ok = kr.state == "completed" && kr.outcome == "rejected" && effects[k] == 0
			if ok {
				r.Rejected++
			}
		default:
			ok = kr.state != "completed" && effects[k] == 0 && dlqKeys[k] > 0
			if ok {
				r.DeadLetteredKeys++
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

	rows, err = s.pool.Query(ctx, `SELECT outcome, sum(n) FROM `+sch+`.stats GROUP BY outcome`)
	if err == nil {
		for rows.Next() {
			var o string
			var n int64
			if rows.Scan(&o, &n) == nil {
				r.Outcomes[o] = n
			}
		}
	}

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
		fail("outbox not drained: %d pending, %d parked", r.OutboxPending, r.OutboxParked)
	}
	if r.OutboxRows != r.Processed || r.OutboxDoubled > 0 {
		fail("outbox holds %d rows (%d ids twice) for %d processed ops", r.OutboxRows, r.OutboxDoubled, r.Processed)
	}
	if r.ForwardMissing > 0 || r.ForwardForeign > 0 || r.ForwardCorrupt > 0 {
		fail("output queue: %d forwarded messages missing, %d with an unknown message_id, %d with a wrong body",
			r.ForwardMissing, r.ForwardForeign, r.ForwardCorrupt)
	}
	if r.DLQMissing > 0 || r.DLQUnexpected > 0 || r.DLQNoError > 0 {
		fail("DLQ: %d poison ops missing, %d unexpected dead letters (by reason %v), %d without x-idemq-error",
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

// deadLetterReason is x-idemq-reason, or the broker's own reason (x-death)
// for a message the broker dead-lettered itself (the delivery limit).
func deadLetterReason(h amqp.Table) string {
	if r, ok := h[consumer.HeaderReason].(string); ok && r != "" {
		return r
	}
	if deaths, ok := h["x-death"].([]any); ok && len(deaths) > 0 {
		if t, ok := deaths[0].(amqp.Table); ok {
			if r, ok := t["reason"].(string); ok {
				return "broker:" + r
			}
		}
	}
	return "unknown"
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
	p("  messages     %d planned: %d ops (%d ok, %d reject, %d poison), %d duplicates (%d bursts of %d), %d flaky ops, %d keys shared by two tenants, %d keys in the header",
		r.Planned, r.Ops, r.ByKind[kindOK], r.ByKind[kindReject], r.ByKind[kindPoison]+r.ByKind[kindPoisonJSON],
		r.Duplicates, r.Bursts, burstSize, r.Flaky, r.SharedKeys, r.HeaderKeys)
	p("  published    %d confirmed (%d sent again after a broker fault, %d publisher reconnects, %d returned)",
		r.Confirmed, r.Republished, r.PublisherReconnects, r.Returned)
	p("  ops          %d processed, %d rejected, %d dead-lettered, %d LOST", r.Processed, r.Rejected, r.DeadLetteredKeys, r.Lost)
	p("  effects      %d ledger rows for %d processed ops: %d keys DOUBLED, %d stray", r.Effects, r.Processed, r.DoubledKeys, r.StrayEffects)
	p("  keys         %d reservations for %d ops (takeovers and retries), %d in progress under a lease, %d released (poison)",
		r.Reservations, r.Ops, r.Leased, r.Released)
	p("  outbox       %d rows, %d pending, %d parked", r.OutboxRows, r.OutboxPending, r.OutboxParked)
	p("  forwarded    %d messages, %d distinct message_ids (%d extra copies, same id), %d missing, %d foreign, %d corrupt",
		r.Forwarded, r.ForwardedIDs, r.ForwardCopies, r.ForwardMissing, r.ForwardForeign, r.ForwardCorrupt)
	p("  DLQ          %d messages, %d keys (%d extra copies), by reason %v; %d poison missing, %d unexpected",
		r.DLQMessages, r.DLQKeys, r.DLQCopies, sortedMap(r.DLQByReason), r.DLQMissing, r.DLQUnexpected)
	p("  queues       %d left in the work queue, %d in the retry tiers", r.WorkLeft, r.RetryLeft)
	p("  outcomes     %s (workers' counters, best effort)", sortedMap(r.Outcomes))
	p("  workers      %d restarts after SIGKILL", r.WorkerRestarts)

	byKind := map[string][]faultRecord{}
	for _, f := range r.Faults {
		byKind[f.Kind] = append(byKind[f.Kind], f)
	}
	p("  faults       %d injected", len(r.Faults))
	for _, k := range faultKinds {
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
