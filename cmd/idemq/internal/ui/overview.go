package ui

import (
	"context"
	"errors"
	"maps"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/idemq/idemq/cmd/idemq/internal/dlq"
	"github.com/idemq/idemq/dedup"
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
}

type overviewView struct {
	At        time.Time
	Scopes    []dedup.ScopeStats
	ScopesErr string
	Queues    []queueView
	Outbox    outbox.Backlog
	OutboxErr string
	Refresh   time.Duration
}

func (s *Server) overview(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 15*time.Second)
	defer cancel()
	v := overviewView{At: time.Now(), Refresh: s.cfg.Refresh}
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
	for _, name := range slices.Sorted(maps.Keys(s.queues)) {
		v.Queues = append(v.Queues, s.queueState(ctx, s.queues[name]))
	}
	wg.Wait()
	s.renderRefresh(w, r, http.StatusOK, "overview", "Overview", v, s.cfg.Refresh)
}

// queueState reads the depths of q's queues and counts its dead letters by reason.
func (s *Server) queueState(ctx context.Context, q Queue) queueView {
	t := q.Topology
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
	if v.DLQ.Messages > 0 {
		c, err := s.countLetters(ctx, q, v.DLQ.Messages)
		if err != nil {
			v.Err = errText(err)
		}
		v.ByReason, v.Partial = c.byReason, c.read < c.inQueue
	}
	return v
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
