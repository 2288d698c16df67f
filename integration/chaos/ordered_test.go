package chaos

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
)

// The ordered soak: entities (an account, an order) whose events must take
// effect once each and in the entity's order, whatever the faults do.
//
// Each entity has Events events, numbered from 1 (x-sequence), published
// to the partitioned queue's exchange Q.order with the entity as
// x-ordering-key. The publication order interleaves the entities and moves
// each event early or late by up to orderedWindow rounds, so that an
// entity's events often arrive out of order; 20% of the messages are
// duplicates (some right behind their event, most long after it, a few in
// bursts of burstSize concurrent copies) and 5% of the events fail their
// first attempt or two with an infrastructure error, so that they come back
// from a retry tier behind later events of their entity. The workers
// consume every partition with ordering on (single-active-consumer: one of
// them takes each partition, the others stand by); the handler writes a
// ledger row and forwards the event through the outbox with the entity as
// its ordering key.
//
// The checks: per entity, the ledger rows, in the order they were written,
// are exactly 1…Events (nothing lost, nothing doubled, nothing out of
// order); every event's key is completed and its entity's last applied
// sequence is Events, no key is blocked and no dead letter was made; the
// forwarded stream on the output queue holds, per entity, every event in
// order, numbered again by the outbox (x-sequence) the same as at the
// start, a relay's repeat of a message already there (same message_id) the
// only copy allowed.

// orderedShape makes a soak ordered (soakOptions.Ordered).
type orderedShape struct {
	Keys, Events, Partitions int
}

// orderedWindow is how many rounds (one event of every entity) an event
// may be published early or late by.
const orderedWindow = 3

// orderedFaultKinds are the faults of an ordered soak: the queue deletions
// are left out (they are the unordered soak's, on an unpartitioned queue),
// and a worker is killed while it is the active consumer of a partition.
var orderedFaultKinds = []string{
	faultActiveKill, faultCloseAll, faultBrokerStop, faultPGTerminate, faultPGRestart,
	faultPGStopImmed, faultNetLatency, faultNetBlackhole, faultNetResetPeer,
}

// orderedTenants are the tenants the entities belong to, in turn: an
// ordering key is scoped by its tenant.
var orderedTenants = []string{"", "acme", "Ümlaut Straße/ü"}

// buildOrderedPlan lays out sh.Keys entities of sh.Events events each.
func buildOrderedPlan(sh orderedShape, seed uint64) plan {
	rng := rand.New(rand.NewPCG(seed, 0x0d3e7ed))
	p := plan{ByKind: map[string]int{}}
	slot := []float64{}
	rank := rng.Perm(sh.Keys)
	for k := range sh.Keys {
		entity := fmt.Sprintf("acct-%04d", k)
		for seq := 1; seq <= sh.Events; seq++ {
			o := op{
				Index: len(p.Ops), Tenant: orderedTenants[k%len(orderedTenants)],
				Key: fmt.Sprintf("%s-e%04d", entity, seq), Kind: kindOK,
				OrderingKey: entity, Sequence: seq,
			}
			if rng.IntN(100) < 5 {
				o.FailFirst = 1 + rng.IntN(2)
				p.Flaky++
			}
			if rng.IntN(10) == 0 {
				o.InHeader = true
				p.HeaderKeys++
			}
			o.Body = body(rng, o)
			p.Ops = append(p.Ops, o)
			p.ByKind[kindOK]++
			round := float64(seq-1) + rng.Float64()*orderedWindow
			slot = append(slot, round*float64(sh.Keys)+float64(rank[k]))
		}
	}
	n := len(p.Ops)
	bursts := max(2, n/1000)
	for _, i := range rng.Perm(n)[:bursts] {
		p.Ops[i].Burst = true
	}
	p.Bursts = bursts
	for i := range p.Ops {
		copies := 1
		if p.Ops[i].Burst {
			copies = burstSize
			p.Duplicates += burstSize - 1
		}
		p.Pubs = append(p.Pubs, publication{Op: i, Copies: copies, slot: slot[i]})
	}
	for dups := n * 20 / 100; p.Duplicates < dups; p.Duplicates++ {
		i := rng.IntN(n)
		behind := float64(sh.Keys) * (1 + float64(rng.IntN(max(1, sh.Events/2))))
		if rng.IntN(10) < 3 {
			behind = 1 + float64(rng.IntN(sh.Keys))
		}
		p.Pubs = append(p.Pubs, publication{Op: i, Copies: 1, slot: slot[i] + behind + rng.Float64()})
	}
	slices.SortStableFunc(p.Pubs, func(a, b publication) int { return cmp.Compare(a.slot, b.slot) })
	for _, pub := range p.Pubs {
		p.Total += pub.Copies
	}
	return p
}

// orderedFindings is what an ordered soak found (report.Ordered).
type orderedFindings struct {
	Keys, Events, Partitions int
	// Effects are the ledger rows; Lost the events without one, Doubled
	// those with more, OutOfOrder the rows written before an earlier event
	// of their entity, Stray the rows of no event.
	Effects, Lost, Doubled, OutOfOrder, Stray int
	// DisorderedEntities have a lost, doubled or out-of-order event.
	DisorderedEntities int
	Completed, Leased  int
	// Applied are the entities whose last applied sequence is Events;
	// Behind the others, Blocked those blocked, Skips the operators' skips.
	Applied, Behind, Blocked, Skips int
	DeadLetters                     int
	WorkLeft, RetryLeft             int
	OutboxRows, OutboxPending       int
	// The forwarded stream: messages, extra copies of a message_id already
	// there, events missing, messages out of order (a first arrival that
	// is not its entity's next event), x-sequence or x-ordering-key other
	// than the event's, unknown messages.
	Forwarded, ForwardCopies, ForwardMissing, ForwardDisorder, ForwardRenumbered, ForwardForeign int
	// Failovers are the single-active-consumer failovers the faults made.
	Failovers int
	Examples  []string
}

// verifyOrdered checks the ordered soak's invariant (see the top of this file).
func (s *soak) verifyOrdered(ctx context.Context) *report {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Minute)
	defer cancel()
	r := s.newReport()
	sh := s.o.Ordered
	f := &orderedFindings{Keys: sh.Keys, Events: sh.Events, Partitions: sh.Partitions}
	r.Ordered = f
	fail := func(format string, args ...any) { r.Failures = append(r.Failures, fmt.Sprintf(format, args...)) }
	example := func(format string, args ...any) {
		if len(f.Examples) < 8 {
			f.Examples = append(f.Examples, fmt.Sprintf(format, args...))
		}
	}
	sch := pgx.Identifier{s.schema}.Sanitize()
	entityOf := func(o *op) scoped { return scoped{o.Tenant, o.OrderingKey} }
	disordered := map[scoped]bool{}

	// The effects, in the order they were written.
	effects := make([]int, len(s.plan.Ops))
	next := map[scoped]int{}
	rows, err := s.pool.Query(ctx, `SELECT tenant, key, op FROM `+sch+`.ledger ORDER BY n`)
	if err != nil {
		fail("read ledger: %v", err)
		return r
	}
	for rows.Next() {
		var tenant, key string
		var idx int
		if err := rows.Scan(&tenant, &key, &idx); err != nil {
			fail("read ledger: %v", err)
			return r
		}
		f.Effects++
		if idx < 0 || idx >= len(s.plan.Ops) || s.plan.Ops[idx].Tenant != tenant || s.plan.Ops[idx].Key != key {
			f.Stray++
			continue
		}
		o := &s.plan.Ops[idx]
		e := entityOf(o)
		effects[idx]++
		want := cmp.Or(next[e], 1)
		switch {
		case effects[idx] > 1:
			f.Doubled++
			disordered[e] = true
			example("%s/%s event %d applied twice", e.tenant, e.key, o.Sequence)
		case o.Sequence != want:
			f.OutOfOrder++
			disordered[e] = true
			example("%s/%s event %d applied when %d was next", e.tenant, e.key, o.Sequence, want)
		}
		if o.Sequence >= want {
			next[e] = o.Sequence + 1
		}
	}
	if err := rows.Err(); err != nil {
		fail("read ledger: %v", err)
		return r
	}
	for i := range s.plan.Ops {
		if effects[i] == 0 {
			f.Lost++
			o := &s.plan.Ops[i]
			disordered[entityOf(o)] = true
			example("%s/%s event %d never applied", o.Tenant, o.OrderingKey, o.Sequence)
		}
	}

	// The keys and the entities' last applied sequences.
	err = s.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE state = 'completed' AND outcome = 'ok'),
       count(*) FILTER (WHERE state = 'in_progress' AND locked_until > now())
FROM `+sch+`.keys WHERE consumer = $1`, consumerName).Scan(&f.Completed, &f.Leased)
	if err != nil {
		fail("read keys: %v", err)
	}
	err = s.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE last_sequence = $2),
       count(*) FILTER (WHERE last_sequence <> $2), count(*) FILTER (WHERE blocked_at IS NOT NULL),
       (SELECT count(*) FROM `+sch+`.ordering_skips)
FROM `+sch+`.ordering_keys WHERE consumer = $1`, consumerName, sh.Events).Scan(&f.Applied, &f.Behind, &f.Blocked, &f.Skips)
	if err != nil {
		fail("read ordering keys: %v", err)
	}
	err = s.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+sch+`.outbox_published) + (SELECT count(*) FROM `+sch+`.outbox),
       (SELECT count(*) FROM `+sch+`.outbox WHERE published_at IS NULL)`).Scan(&f.OutboxRows, &f.OutboxPending)
	if err != nil {
		fail("read outbox: %v", err)
	}

	// The forwarded stream, in queue order.
	byID := map[string]int{}
	for i := range s.plan.Ops {
		byID[s.plan.Ops[i].forwardedID(consumerName)] = i
	}
	out, err := s.insp.readAll(s.outQ)
	if err != nil {
		fail("read output queue: %v", err)
	}
	f.Forwarded = len(out)
	arrived := make([]bool, len(s.plan.Ops))
	nextOut := map[string]int{}
	for _, d := range out {
		idx, ok := byID[d.MessageId]
		if !ok {
			f.ForwardForeign++
			continue
		}
		o := &s.plan.Ops[idx]
		if arrived[idx] {
			f.ForwardCopies++
			continue
		}
		arrived[idx] = true
		if key, _ := d.Headers[consumer.HeaderOrderingKey].(string); key != o.OrderingKey || d.Headers[consumer.HeaderSequence] != int64(o.Sequence) {
			f.ForwardRenumbered++
			example("forwarded %s/%s event %d arrived as %v/%v", o.Tenant, o.OrderingKey, o.Sequence,
				d.Headers[consumer.HeaderOrderingKey], d.Headers[consumer.HeaderSequence])
		}
		if want := cmp.Or(nextOut[o.OrderingKey], 1); o.Sequence != want {
			f.ForwardDisorder++
			example("forwarded %s/%s event %d arrived when %d was next", o.Tenant, o.OrderingKey, o.Sequence, want)
		}
		nextOut[o.OrderingKey] = max(nextOut[o.OrderingKey], o.Sequence+1)
	}
	for i := range s.plan.Ops {
		if !arrived[i] {
			f.ForwardMissing++
		}
	}

	st, err := s.insp.state()
	if err != nil {
		fail("read queues: %v", err)
	}
	f.DeadLetters, f.WorkLeft, f.RetryLeft = st.DLQ, st.Work, st.Retrying
	f.DisorderedEntities = len(disordered)
	for _, fr := range r.Faults {
		if fr.Kind == faultActiveKill && fr.Err == nil && strings.Contains(fr.Detail, "active consumer of") {
			f.Failovers++
		}
	}

	want := sh.Keys * sh.Events
	if f.Lost > 0 || f.Doubled > 0 || f.OutOfOrder > 0 || f.Stray > 0 {
		fail("effects: %d events LOST, %d DOUBLED, %d OUT OF ORDER, %d stray, in %d entities; e.g. %s",
			f.Lost, f.Doubled, f.OutOfOrder, f.Stray, f.DisorderedEntities, strings.Join(f.Examples, "; "))
	}
	if f.Completed != want || f.Leased > 0 {
		fail("keys: %d of %d completed, %d left under a lease", f.Completed, want, f.Leased)
	}
	if f.Applied != sh.Keys || f.Behind > 0 || f.Blocked > 0 || f.Skips > 0 {
		fail("ordering keys: %d of %d entities at sequence %d, %d behind, %d blocked, %d skips", f.Applied, sh.Keys, sh.Events, f.Behind, f.Blocked, f.Skips)
	}
	if f.DeadLetters > 0 || f.WorkLeft > 0 || f.RetryLeft > 0 {
		fail("queues: %d dead letters, %d messages left in the partitions, %d in their retry tiers", f.DeadLetters, f.WorkLeft, f.RetryLeft)
	}
	if f.OutboxRows != want || f.OutboxPending > 0 {
		fail("outbox: %d rows for %d events, %d pending", f.OutboxRows, want, f.OutboxPending)
	}
	if f.ForwardMissing > 0 || f.ForwardDisorder > 0 || f.ForwardRenumbered > 0 || f.ForwardForeign > 0 {
		fail("forwarded stream: %d events missing, %d out of order, %d numbered otherwise, %d unknown; e.g. %s",
			f.ForwardMissing, f.ForwardDisorder, f.ForwardRenumbered, f.ForwardForeign, strings.Join(f.Examples, "; "))
	}
	if r.Confirmed < int64(r.Planned) {
		fail("publisher confirmed %d of %d messages (%v)", r.Confirmed, r.Planned, r.PublishErr)
	}
	return r
}

// lines prints the ordered findings into the report.
func (f *orderedFindings) lines(p func(format string, args ...any)) {
	p("  effects      %d ledger rows for %d events: %d LOST, %d DOUBLED, %d OUT OF ORDER, %d stray (%d entities affected)",
		f.Effects, f.Keys*f.Events, f.Lost, f.Doubled, f.OutOfOrder, f.Stray, f.DisorderedEntities)
	p("  keys         %d completed, %d in progress under a lease", f.Completed, f.Leased)
	p("  entities     %d of %d at their last sequence %d, %d behind, %d blocked, %d skips; %d dead letters",
		f.Applied, f.Keys, f.Events, f.Behind, f.Blocked, f.Skips, f.DeadLetters)
	p("  partitions   %d; %d single-active-consumer failovers by SIGKILL of the active worker", f.Partitions, f.Failovers)
	p("  outbox       %d rows, %d pending", f.OutboxRows, f.OutboxPending)
	p("  forwarded    %d messages (%d repeats of a message_id already there), %d events missing, %d OUT OF ORDER, %d numbered otherwise, %d unknown",
		f.Forwarded, f.ForwardCopies, f.ForwardMissing, f.ForwardDisorder, f.ForwardRenumbered, f.ForwardForeign)
	p("  queues       %d left in the partitions, %d in their retry tiers", f.WorkLeft, f.RetryLeft)
}

// activeWorker finds the worker that is the active consumer of a partition
// picked at random (rabbitmqctl: the consumer, its channel, its connection's
// name, which is the worker's) and describes it.
func (s *soak) activeWorker(ctx context.Context) (int, string, error) {
	ctl := s.svc.rabbitmqctl
	if s.o.Cluster {
		ctl = func(ctx context.Context, args ...string) (string, error) {
			return s.svc.cluster.upNode().ctl(ctx, args...)
		}
	}
	list := func(out any, args ...string) error {
		text, err := ctl(ctx, append(args, "-q", "--formatter", "json")...)
		if err != nil {
			return err
		}
		if err := json.Unmarshal([]byte(text), out); err != nil {
			return fmt.Errorf("rabbitmqctl %s: %w", args[0], err)
		}
		return nil
	}
	var consumers []struct {
		Queue   string `json:"queue_name"`
		Channel string `json:"channel_pid"`
		Active  bool   `json:"active"`
	}
	var channels []struct{ PID, Connection string }
	var conns []struct {
		PID        string  `json:"pid"`
		Properties [][]any `json:"client_properties"`
	}
	if err := list(&consumers, "list_consumers", "queue_name", "channel_pid", "active"); err != nil {
		return 0, "", err
	}
	if err := list(&channels, "list_channels", "pid", "connection"); err != nil {
		return 0, "", err
	}
	if err := list(&conns, "list_connections", "pid", "client_properties"); err != nil {
		return 0, "", err
	}
	names := map[string]string{}
	for _, c := range conns {
		for _, prop := range c.Properties {
			if len(prop) == 3 && prop[0] == "connection_name" {
				names[c.PID], _ = prop[2].(string)
			}
		}
	}
	connOf := map[string]string{}
	for _, c := range channels {
		connOf[c.PID] = c.Connection
	}
	part := s.rng.IntN(len(s.insp.work))
	queue := s.insp.work[part]
	for _, c := range consumers {
		if c.Queue != queue || !c.Active {
			continue
		}
		name := names[connOf[c.Channel]]
		var i, p int
		if _, err := fmt.Sscanf(strings.TrimPrefix(name, s.workerPrefix()), "%d-p%d", &i, &p); err != nil || i >= s.o.Workers {
			return 0, "", fmt.Errorf("active consumer of %s on connection %q: not a worker's", queue, name)
		}
		return i, fmt.Sprintf(", the active consumer of partition %d,", part), nil
	}
	return 0, "", fmt.Errorf("partition %s has no active consumer", queue)
}
