package ui

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"sync"
	"time"

	"github.com/idemq/idemq/cmd/idemq/internal/dlq"
)

// Defaults of HealthLimits.
const (
	DefaultOutboxAge = time.Minute
	DefaultRetrying  = 100
)

// HealthLimits bound what the overview and /api/health flag as backing up.
// A zero field takes its default.
type HealthLimits struct {
	// OutboxAge: an outbox whose oldest pending row is older than this is
	// flagged (its relays are down, behind, or refused by the broker).
	// Default DefaultOutboxAge.
	OutboxAge time.Duration
	// Retrying: a queue with more messages than this in its retry tiers is
	// flagged (its handlers fail with infrastructure errors). Default
	// DefaultRetrying.
	Retrying int
}

// severity says how soon a flag needs the operator.
type severity string

const (
	// critical: messages do not move, or the UI cannot see whether they do.
	critical severity = "critical"
	// warning: messages move, but something is piling up or waits for a person.
	warning severity = "warning"
)

// rank orders severities, the most urgent first.
func (s severity) rank() int {
	if s == critical {
		return 0
	}
	return 1
}

// flag is one thing the operator should look at.
type flag struct {
	Severity severity `json:"severity"`
	// Check names what was checked, for scripts: the words are listed in
	// docs/ui.md and do not change.
	Check string `json:"check"`
	// Subject is what the flag is about: a consumer scope, a queue, "outbox".
	Subject string `json:"subject"`
	// Problem says what is wrong, Action what to do about it first.
	Problem string `json:"problem"`
	Action  string `json:"action"`
	// Link is the UI's page (or the overview's section) that shows it.
	Link string `json:"link"`
}

// health is what the state asks of the operator: nothing (Status "ok"), or
// its flags, the most urgent first.
type health struct {
	// Status is "ok", or the most urgent flag's severity.
	Status    string    `json:"status"`
	CheckedAt time.Time `json:"checked_at"`
	Flags     []flag    `json:"flags"`
}

// arrivalWindow is how far back the DLQ check looks for new dead letters.
const arrivalWindow = time.Hour

// assess checks v: each check that fails is a flag.
func (s *Server) assess(v overviewView) health {
	limits := s.limits()
	var flags []flag
	add := func(sev severity, check, subject, link, action, problem string, args ...any) {
		flags = append(flags, flag{Severity: sev, Check: check, Subject: subject, Link: link, Action: upperFirst(action),
			Problem: fmt.Sprintf(problem, args...)})
	}
	if v.ScopesErr != "" {
		add(critical, "store_unreadable", "keys", "/#scopes", "check that Postgres is up and the schema migrated (idemq migrate)",
			"the key store cannot be read: %s", v.ScopesErr)
	}
	for _, sc := range v.Scopes {
		if sc.Expired > 0 {
			add(warning, "expired_leases", sc.Consumer, "/#scopes",
				"the next delivery of each takes it over; if the count stays, find the worker that stopped mid-handler (its messages wait unacked until its connection closes)",
				"%d key(s) of consumer %s are in progress past their lease: the worker that held them died or lost Postgres", sc.Expired, sc.Consumer)
		}
	}
	for _, q := range v.Queues {
		if len(q.Partitions) > 0 {
			s.assessPartitioned(q, limits, add, v.At)
			continue
		}
		s.assessQueue(q, limits, add, v.At)
	}
	switch b := v.Outbox; {
	case v.OutboxErr != "":
		add(critical, "outbox_unreadable", "outbox", "/outbox", "check that Postgres is up and the schema migrated (idemq migrate)",
			"the outbox cannot be read: %s", v.OutboxErr)
	default:
		if b.Parked > 0 {
			add(warning, "outbox_parked", "outbox", "/outbox", "declare or bind what they are published to, then unpark them",
				"%d outbox row(s) are parked: the broker could not route them, and they wait for you", b.Parked)
		}
		if b.Pending > 0 && b.OldestAge > limits.OutboxAge {
			add(warning, "outbox_behind", "outbox", "/outbox", "check that a relay runs (idemq relay) and what its log says about the broker",
				"%d outbox row(s) wait to be published, the oldest for %s (more than %s)", b.Pending, age(b.OldestAge), limits.OutboxAge)
		}
	}
	slices.SortStableFunc(flags, func(a, b flag) int { return cmp.Compare(a.Severity.rank(), b.Severity.rank()) })
	h := health{Status: "ok", CheckedAt: v.At, Flags: flags}
	if len(flags) > 0 {
		h.Status = string(flags[0].Severity)
	}
	if h.Flags == nil {
		h.Flags = []flag{}
	}
	return h
}

type addFlag func(sev severity, check, subject, link, action, problem string, args ...any)

// assessQueue checks one queue: its queues exist and are read, ready
// messages have a consumer, the retry tiers hold at most limits.Retrying,
// and no letter came into the DLQ within arrivalWindow.
func (s *Server) assessQueue(q queueView, limits HealthLimits, add addFlag, now time.Time) {
	anchor := "/#queue-" + q.Name
	if q.Err != "" {
		add(critical, "queue_unreadable", q.Name, anchor, "check that RabbitMQ is up and the UI's credentials",
			"%s cannot be read: %s", q.Name, q.Err)
		if q.Work.Name == "" { // no connection: nothing was read
			return
		}
	}
	for _, d := range slices.Concat([]depth{q.Work}, q.Tiers, []depth{q.DLQ}) {
		s.assessDepth(d, add, anchor)
	}
	if w := q.Work; !w.Missing && w.Err == "" && w.Messages > 0 && w.Consumers == 0 {
		add(critical, "no_consumer", q.Name, anchor, "start its workers (idemq run, or the service that consumes it)",
			"%s has %d message(s) ready and no consumer: nothing takes them", q.Name, w.Messages)
	}
	retrying := 0
	for _, d := range q.Tiers {
		retrying += d.Messages
	}
	if retrying > limits.Retrying {
		add(warning, "retrying", q.Name, anchor, "look at the workers' log for the failure they retry (ERROR lines with the queue's name)",
			"%d message(s) of %s wait in its retry tiers (more than %d): its handlers fail with infrastructure errors", retrying, q.Name, limits.Retrying)
	}
	s.assessArrivals(q.Name, q.DLQ, add, now)
}

// assessDepth flags a queue that does not exist or could not be read.
func (s *Server) assessDepth(d depth, add addFlag, anchor string) {
	switch {
	case d.Missing:
		add(critical, "queue_missing", d.Name, anchor, "declare the topology (idemq topology apply with the workers' flags)",
			"%s does not exist: what is published or retried to it is lost or refused", d.Name)
	case d.Err != "":
		add(critical, "queue_unreadable", d.Name, anchor, "check that RabbitMQ is up and the UI's credentials",
			"%s cannot be read: %s", d.Name, d.Err)
	}
}

// assessArrivals flags a DLQ that letters came into within arrivalWindow.
func (s *Server) assessArrivals(queue string, d depth, add addFlag, now time.Time) {
	if d.Missing || d.Err != "" {
		return
	}
	n, since := s.arrivals.count(d.Name, now)
	if n == 0 {
		return
	}
	window := "in the last hour"
	if now.Sub(since) < arrivalWindow-time.Minute {
		window = fmt.Sprintf("in the last %s (since the UI first read it)", age(now.Sub(since)))
	}
	add(warning, "dlq_grew", d.Name, "/dlq?queue="+url.QueryEscape(queue), "read their reasons; replay them once the cause is fixed",
		"%d dead letter(s) came into %s %s; it holds %d", n, d.Name, window, d.Messages)
}

// assessPartitioned checks each partition of a partitioned queue as a
// queue, with its active consumer, and the consumer's blocked ordering keys.
func (s *Server) assessPartitioned(q queueView, limits HealthLimits, add addFlag, now time.Time) {
	anchor := "/#queue-" + q.Name
	if q.Err != "" { // no connection: no partition was read
		add(critical, "queue_unreadable", q.Name, anchor, "check that RabbitMQ is up and the UI's credentials",
			"%s cannot be read: %s", q.Name, q.Err)
		return
	}
	if q.OwnersErr != "" {
		add(warning, "owners_unreadable", q.Name, anchor, "migrate the store (idemq migrate)",
			"the active consumers of %s cannot be read: %s", q.Name, q.OwnersErr)
	}
	for _, p := range q.Partitions {
		pa := "/#partition-" + p.Name
		for _, d := range slices.Concat([]depth{p.Work}, p.Tiers, []depth{p.DLQ}) {
			s.assessDepth(d, add, pa)
		}
		if p.Stalled != "" {
			add(critical, "partition_stalled", p.Name, pa, "start a worker for it, or find why its active consumer stopped (idemq order status)",
				"partition %s: %s; its keys' messages wait", p.Name, p.Stalled)
		}
		if p.InTiers > limits.Retrying {
			add(warning, "retrying", p.Name, pa, "look at the workers' log for the failure they retry",
				"%d message(s) of %s wait in its retry tiers (more than %d), and each key's later messages wait behind them", p.InTiers, p.Name, limits.Retrying)
		}
		s.assessArrivals(p.Name, p.DLQ, add, now)
	}
	switch b := q.Blocked; {
	case b.Err != "":
		add(warning, "ordering_unreadable", q.Consumer, anchor, "migrate the store (idemq migrate)",
			"the blocked ordering keys of %s cannot be read: %s", q.Consumer, b.Err)
	case len(b.Keys) > 0:
		n := fmt.Sprint(len(b.Keys))
		if b.More {
			n = "more than " + n
		}
		add(warning, "ordering_blocked", q.Consumer, anchor, "replay the dead-lettered message once its cause is fixed, or skip it (idemq order skip)",
			"%s ordering key(s) of %s are blocked behind a dead letter: their later messages wait", n, q.Consumer)
	}
}

func (s *Server) limits() HealthLimits {
	l := s.cfg.Health
	l.OutboxAge = cmp.Or(l.OutboxAge, DefaultOutboxAge)
	l.Retrying = cmp.Or(l.Retrying, DefaultRetrying)
	return l
}

// healthAPI answers GET /api/health: the overview's checks as JSON, 200
// when nothing is critical, 503 when something is.
func (s *Server) healthAPI(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), readTimeout)
	defer cancel()
	h := s.assess(s.state(ctx, false))
	code := http.StatusOK
	if h.Status == string(critical) {
		code = http.StatusServiceUnavailable
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(h)
}

// sampleEvery is how often the server reads the depth of each DLQ by itself,
// so that the DLQ check knows what came in while no page was open.
const sampleEvery = time.Minute

// sample reads the depth of each DLQ every sampleEvery until ctx ends.
func (s *Server) sample(ctx context.Context) {
	t := time.NewTicker(sampleEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		conn, err := s.amqpConn()
		if err != nil {
			continue
		}
		for _, q := range s.queues {
			if st, err := dlq.Inspect(conn, q.Topology.DLQ); err == nil {
				s.arrivals.observe(q.Topology.DLQ, st.Messages, time.Now())
			}
		}
	}
}

// arrivals estimates how many letters came into each DLQ within
// arrivalWindow from the depths the server reads: the sum of the rises
// between one read and the next. It is a lower bound (letters that came and
// left between two reads are not seen), and it starts when the server does.
type arrivals struct {
	mu    sync.Mutex
	byDLQ map[string]*arrivalLog
}

// arrivalLog is one DLQ's reads: the first, the depth at the latest, and
// the rises by minute within arrivalWindow, the oldest first.
type arrivalLog struct {
	first time.Time
	depth int
	rises []rise
}

type rise struct {
	minute time.Time
	n      int
}

// observe records that dlq held depth at now.
func (a *arrivals) observe(dlq string, depth int, now time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.byDLQ == nil {
		a.byDLQ = map[string]*arrivalLog{}
	}
	l := a.byDLQ[dlq]
	if l == nil {
		a.byDLQ[dlq] = &arrivalLog{first: now, depth: depth}
		return
	}
	if n := depth - l.depth; n > 0 {
		m := now.Truncate(time.Minute)
		if k := len(l.rises); k > 0 && l.rises[k-1].minute.Equal(m) {
			l.rises[k-1].n += n
		} else {
			l.rises = append(l.rises, rise{minute: m, n: n})
		}
	}
	l.depth = depth
	l.prune(now)
}

func (l *arrivalLog) prune(now time.Time) {
	i := 0
	for i < len(l.rises) && now.Sub(l.rises[i].minute) > arrivalWindow {
		i++
	}
	l.rises = l.rises[i:]
}

// count returns the letters that came into dlq within arrivalWindow of now,
// and since when the count runs: the window's start, or the first read when
// that is later.
func (a *arrivals) count(dlq string, now time.Time) (int, time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	l := a.byDLQ[dlq]
	if l == nil {
		return 0, now
	}
	l.prune(now)
	n := 0
	for _, r := range l.rises {
		n += r.n
	}
	since := now.Add(-arrivalWindow)
	if l.first.After(since) {
		since = l.first
	}
	return n, since
}

// upperFirst is s with its first letter in upper case (s is ASCII here).
func upperFirst(s string) string {
	if s == "" || s[0] < 'a' || s[0] > 'z' {
		return s
	}
	return string(s[0]-'a'+'A') + s[1:]
}
