package ui

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemq/idemq/cmd/idemq/internal/dlq"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/ordering"
	"github.com/idemq/idemq/outbox"
)

// depth is one queue's depth from a passive declare.
type depth struct {
	Name      string
	Delay     time.Duration
	Messages  int
	Consumers int
	Missing   bool
	Err       string
	// Flagged: a health flag is about this queue.
	Flagged bool
}

// reasonCount is one reason's count of dead letters.
type reasonCount struct {
	Reason string
	Count  int
}

type queueView struct {
	Name     string
	Consumer string
	Work     depth
	Tiers    []depth
	DLQ      depth
	// ByReason counts the dead letters read (at most Config.LetterLimit,
	// Partial when the DLQ held more).
	ByReason []reasonCount
	Partial  bool
	Err      string

	// A partitioned queue's: the exchange publishers publish to, each
	// partition, the active consumers' read error (OwnersErr), and its
	// consumer's blocked ordering keys.
	Exchange   string
	Partitions []partitionView
	OwnersErr  string
	Blocked    blockedView
}

// partitionView is one partition of a partitioned queue: its own queues,
// and who consumes it.
type partitionView struct {
	queueView
	// Standby counts the consumers standing by: single-active-consumer
	// delivers to one of them.
	Standby int
	// InTiers is the ready messages of its retry tiers; TiersErr says which
	// tier could not be read.
	InTiers  int
	TiersErr string
	// Owner is its active consumer as the consumers recorded it (nil: none
	// recorded), last seen LastSeen ago.
	Owner    *ordering.Owner
	LastSeen time.Duration
	// Stalled says why its ready messages may not move ("" when nothing does).
	Stalled string
}

// blockedView lists a consumer's blocked ordering keys, the longest
// blocked first, at most blockedShown of them.
type blockedView struct {
	Keys []blockedKey
	// More: more keys are blocked than are shown.
	More bool
	Err  string
}

// blockedKey is one blocked ordering key: it waits for WaitsFor, Missing
// are the sequences that never came before the one dead-lettered.
type blockedKey struct {
	Tenant, Key                  string
	Last, WaitsFor, DeadLettered int64
	Missing                      string
	Reason                       string
	Since                        *time.Time
}

// blockedShown bounds the blocked keys the overview lists for one consumer
// (`idemq order status` lists them all).
const blockedShown = 20

// ownerStale is how long a partition with ready messages may go without
// its active consumer recording itself before the overview flags it: the
// consumer records at most every 10 seconds while deliveries come.
const ownerStale = time.Minute

type overviewView struct {
	At        time.Time
	Scopes    []dedup.ScopeStats
	ScopesErr string
	Queues    []queueView
	Outbox    outbox.Backlog
	OutboxErr string
	Refresh   time.Duration
	// Health is what the state above asks of the operator; OutboxBehind
	// marks the outbox's age when a flag is about it.
	Health       health
	OutboxBehind bool
}

func (s *Server) overview(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), readTimeout)
	defer cancel()
	v := s.state(ctx, true)
	v.Refresh, v.Health = s.cfg.Refresh, s.assess(v)
	v.mark()
	s.renderRefresh(w, r, http.StatusOK, "overview", "Overview", v, s.cfg.Refresh)
}

// mark marks the depths and the outbox that v's flags are about.
func (v *overviewView) mark() {
	about := map[string]bool{}
	for _, f := range v.Health.Flags {
		about[f.Check+" "+f.Subject] = true
		v.OutboxBehind = v.OutboxBehind || f.Check == "outbox_behind"
	}
	markQueue := func(q *queueView) {
		q.Work.Flagged = about["no_consumer "+q.Name]
		for i := range q.Tiers {
			q.Tiers[i].Flagged = about["retrying "+q.Name]
		}
		q.DLQ.Flagged = about["dlq_grew "+q.DLQ.Name]
	}
	for i := range v.Queues {
		markQueue(&v.Queues[i])
		for j := range v.Queues[i].Partitions {
			markQueue(&v.Queues[i].Partitions[j].queueView)
		}
	}
}

// readTimeout bounds the reads of one overview or health check.
const readTimeout = 15 * time.Second

// state reads what the overview shows: the key store's counts, each queue
// given (with its dead letters counted by reason when letters), and the
// outbox's backlog.
func (s *Server) state(ctx context.Context, letters bool) overviewView {
	v := overviewView{At: time.Now()}
	var wg sync.WaitGroup
	wg.Go(func() {
		st, err := s.store.Stats(ctx)
		if err != nil {
			v.ScopesErr = errText(err)
		}
		v.Scopes = st
	})
	wg.Go(func() {
		b, err := s.outbox.Pending(ctx)
		if err != nil {
			v.OutboxErr = errText(err)
		}
		v.Outbox = b
	})
	for _, q := range s.shown {
		v.Queues = append(v.Queues, s.queueState(ctx, q, letters))
	}
	wg.Wait()
	return v
}

// queueState reads the depths of q's queues and, when letters, counts its
// dead letters by reason; of a partitioned q, those of each partition.
func (s *Server) queueState(ctx context.Context, q Queue, letters bool) queueView {
	t := q.Topology
	if len(t.Partitions) > 0 {
		return s.partitionedState(ctx, q, letters)
	}
	v := queueView{Name: t.Queue, Consumer: q.Consumer}
	conn, err := s.amqpConn()
	if err != nil {
		v.Err = errText(err)
		return v
	}
	inspect := func(name string, delay time.Duration) depth {
		d := depth{Name: name, Delay: delay}
		st, err := dlq.Inspect(conn, name)
		switch {
		case errors.Is(err, dlq.ErrNoQueue):
			d.Missing = true
		case err != nil:
			d.Err = errText(err)
		}
		d.Messages, d.Consumers = st.Messages, st.Consumers
		return d
	}
	v.Work = inspect(t.Queue, 0)
	for _, delay := range t.Delays {
		v.Tiers = append(v.Tiers, inspect(t.TierName(delay), delay))
	}
	v.DLQ = inspect(t.DLQ, 0)
	if !v.DLQ.Missing && v.DLQ.Err == "" {
		s.arrivals.observe(t.DLQ, v.DLQ.Messages, time.Now())
	}
	if letters && v.DLQ.Messages > 0 {
		c, err := s.countLetters(ctx, q, v.DLQ.Messages)
		if err != nil {
			v.Err = errText(err)
		}
		v.ByReason, v.Partial = c.byReason, c.read < c.inQueue
	}
	return v
}

// partitionedState reads each partition of q as a queue of its own, with
// its active consumer, and the blocked ordering keys of q's consumer.
func (s *Server) partitionedState(ctx context.Context, q Queue, letters bool) queueView {
	v := queueView{Name: q.Topology.Queue, Consumer: q.Consumer, Exchange: q.Topology.OrderExchange}
	owners, err := s.owners(ctx, q.Consumer)
	if err != nil {
		v.OwnersErr = storeErr(err, "011_partition_owners")
	}
	// One dial for all: a broker that does not answer is said once, not
	// waited for by each partition.
	_, connErr := s.amqpConn()
	if connErr != nil {
		v.Err = errText(connErr)
	}
	now := time.Now()
	for _, t := range q.Topology.Partitions {
		var p partitionView
		if connErr == nil {
			p.queueView = s.queueState(ctx, Queue{Topology: t, Consumer: q.Consumer}, letters)
		} else {
			p.Name, p.Work.Err, p.DLQ.Err, p.TiersErr = t.Queue, "not read", "not read", "not read"
		}
		p.Standby = max(p.Work.Consumers-1, 0)
		for _, d := range p.Tiers {
			p.InTiers += d.Messages
			switch {
			case d.Missing:
				p.TiersErr = d.Name + " does not exist"
			case d.Err != "":
				p.TiersErr = d.Err
			}
		}
		if o, ok := owners[t.Queue]; ok {
			p.Owner, p.LastSeen = &o, max(now.Sub(o.SeenAt), 0)
		}
		p.Stalled = stalled(p, err == nil)
		v.Partitions = append(v.Partitions, p)
	}
	if q.Consumer != "" {
		v.Blocked = s.blocked(ctx, q.Consumer)
	}
	return v
}

// stalled says why p's ready messages may not be moving: no consumer, or
// an active consumer that has not recorded itself for ownerStale (or ever,
// when the owners could be read). "" when they move, or none are ready.
func stalled(p partitionView, ownersRead bool) string {
	ready := p.Work.Messages
	switch {
	case ready == 0:
		return ""
	case p.Work.Consumers == 0:
		return fmt.Sprintf("%d ready, no consumer", ready)
	case !ownersRead:
		return ""
	case p.Owner == nil:
		return fmt.Sprintf("%d ready, no active consumer recorded", ready)
	case p.LastSeen > ownerStale:
		return fmt.Sprintf("%d ready, the active consumer not seen for %s", ready, age(p.LastSeen))
	}
	return ""
}

// owners returns the partitions' active consumers recorded for consumer
// ("" any), by partition: the one seen last where several consumers
// recorded one.
func (s *Server) owners(ctx context.Context, consumer string) (map[string]ordering.Owner, error) {
	list, err := ordering.Owners(ctx, s.cfg.Pool, s.store.Config().Schema, consumer)
	if err != nil {
		return nil, err
	}
	out := map[string]ordering.Owner{}
	for _, o := range list {
		if prev, ok := out[o.Queue]; !ok || o.SeenAt.After(prev.SeenAt) {
			out[o.Queue] = o
		}
	}
	return out, nil
}

// blocked lists consumer's blocked ordering keys, at most blockedShown.
func (s *Server) blocked(ctx context.Context, consumer string) blockedView {
	keys, err := ordering.Blocked(ctx, s.cfg.Pool, s.store.Config().Schema, consumer, blockedShown+1)
	if err != nil {
		return blockedView{Err: storeErr(err, "010_ordering")}
	}
	var v blockedView
	if len(keys) > blockedShown {
		keys, v.More = keys[:blockedShown], true
	}
	for _, k := range keys {
		b := blockedKey{Tenant: k.Tenant, Key: k.Key, Last: k.LastSequence, WaitsFor: k.LastSequence + 1,
			DeadLettered: k.BlockedSequence, Reason: k.BlockedReason, Since: k.BlockedAt}
		switch first, last := k.LastSequence+1, k.BlockedSequence-1; {
		case last < first:
			b.Missing = "none"
		case last == first:
			b.Missing = strconv.FormatInt(first, 10)
		default:
			b.Missing = fmt.Sprintf("%d … %d", first, last)
		}
		v.Keys = append(v.Keys, b)
	}
	return v
}

// storeErr is a store's error as the overview shows it: a missing table
// names the migration that creates it.
func storeErr(err error, migration string) string {
	var pgErr *pgconn.PgError
	// undefined_table
	if errors.As(err, &pgErr) && pgErr.Code == "42P01" {
		return fmt.Sprintf("the store lacks migration %s (idemq migrate): %s", migration, errText(err))
	}
	return errText(err)
}

// countLetters counts q's dead letters by reason, given the DLQ's depth: from
// the cache when it counted that depth less than countsTTL ago, else from a
// scan that keeps no letter (the overview's peak is one letter's size).
func (s *Server) countLetters(ctx context.Context, q Queue, depth int) (dlqCounts, error) {
	if c, ok := s.jobs.counts.get(q.Topology.Queue, depth); ok {
		return c, nil
	}
	counts := reasonCounts{}
	n, read, err := s.scanLetters(ctx, q, func(m dlq.Message) bool {
		counts.add(m.Reason)
		return true
	})
	c := dlqCounts{inQueue: n, read: read, byReason: counts.sorted()}
	if err == nil {
		s.jobs.counts.put(q.Topology.Queue, c)
	}
	return c, err
}

// countsTTL is how long the counts of a DLQ by reason serve the overview
// while the DLQ's depth stays the same. Without it every refresh of every
// open overview would read every letter of the DLQ, bodies included (basic.get
// always transfers the body): up to LetterLimit bodies each 10 s. A new dead
// letter, one that leaves, and a replay (start and end) make the counts be
// read again at once; only letters that leave and come in in equal numbers
// within countsTTL leave them stale, by at most countsTTL.
const countsTTL = time.Minute

// dlqCounts are one DLQ's letters counted by reason.
type dlqCounts struct {
	inQueue, read int
	byReason      []reasonCount
	at            time.Time
}

// countCache holds the latest dlqCounts of each work queue's DLQ.
type countCache struct {
	mu    sync.Mutex
	byDLQ map[string]dlqCounts
}

// get returns the counts of queue's DLQ when they are fresh: taken less than
// countsTTL ago at the same depth.
func (cc *countCache) get(queue string, depth int) (dlqCounts, bool) {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	c, ok := cc.byDLQ[queue]
	return c, ok && c.inQueue == depth && time.Since(c.at) < countsTTL
}

func (cc *countCache) put(queue string, c dlqCounts) {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	if cc.byDLQ == nil {
		cc.byDLQ = map[string]dlqCounts{}
	}
	c.at = time.Now()
	cc.byDLQ[queue] = c
}

// forget drops the counts of queue's DLQ (a replay changes them).
func (cc *countCache) forget(queue string) {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	delete(cc.byDLQ, queue)
}

// reasonCounts counts dead letters by reason.
type reasonCounts map[string]int

func (c reasonCounts) add(reason string) { c[reason]++ }

// sorted returns the counts by reason, in the reasons' order.
func (c reasonCounts) sorted() []reasonCount {
	out := make([]reasonCount, 0, len(c))
	for _, r := range slices.Sorted(maps.Keys(c)) {
		out = append(out, reasonCount{r, c[r]})
	}
	return out
}
