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
		n, msgs, err := s.readLetters(ctx, q)
		if err != nil {
			v.Err = errText(err)
		}
		v.ByReason, v.Partial = countReasons(msgs), len(msgs) < n
	}
	return v
}

func countReasons(msgs []dlq.Message) []reasonCount {
	counts := map[string]int{}
	for _, m := range msgs {
		counts[m.Reason]++
	}
	out := make([]reasonCount, 0, len(counts))
	for _, r := range slices.Sorted(maps.Keys(counts)) {
		out = append(out, reasonCount{r, counts[r]})
	}
	return out
}
