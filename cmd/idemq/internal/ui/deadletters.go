package ui

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/cmd/idemq/internal/audit"
	"github.com/idemq/idemq/cmd/idemq/internal/dlq"
	"github.com/idemq/idemq/internal/wire"
)

// letterView is one dead letter as the list shows it.
type letterView struct {
	ID string
	// Key is the raw key, shown only with Config.ShowKeys; KeyHash always.
	Key, KeyHash, Tenant      string
	Reason                    string
	ByBroker                  bool
	Attempts                  string
	FirstSeen, Error          string
	OriginalExchange, OrigKey string
	BodySize                  int
	// Doomed says why a replay of it would come straight back ("" when it
	// may succeed); Old marks a letter older than the key retention (its
	// key may be gone: it would run again).
	Doomed string
	Old    bool
}

type deadLettersView struct {
	Queue    string
	Consumer string
	InQueue  int
	Read     int
	ByReason []reasonCount
	Reason   string
	Letters  []letterView
	Err      string
	ShowKeys bool
	// Retention is the key retention letters are marked older than.
	Retention time.Duration
}

// keyScope is where q's dead letters' keys are read from, and in which scope.
func (s *Server) keyScope(q Queue) dlq.KeyScope {
	return dlq.KeyScope{Consumer: q.Consumer, KeyHeader: s.cfg.KeyHeader, TenantHeader: s.cfg.TenantHeader, KeyFrom: s.cfg.KeyFrom}
}

// queueOf returns the configured queue named by the request's queue parameter.
func (s *Server) queueOf(w http.ResponseWriter, r *http.Request) (Queue, bool) {
	name := r.FormValue("queue")
	q, ok := s.queues[name]
	if !ok {
		s.fail(w, r, http.StatusNotFound, fmt.Errorf("queue %q is not one the UI was started with (--queue)", name))
	}
	return q, ok
}

// scanLetters reads up to the configured number of q's dead letters, one at
// a time, and calls fn with each (see dlq.Scan: fn must not keep the body;
// Message.Cut keeps a part). It returns the number of ready messages the DLQ
// held and the number of letters read. The letters a read holds are hidden
// from every other reader until the broker has taken them back, which it
// does shortly after the read's channel closes: so the UI's reads of one DLQ
// take turns, each waiting (briefly) for the DLQ to hold its letters again
// before the next one starts.
//
// Memory: a page holds what fn keeps, and the letter being read. The list
// pages keep a letterView per letter (what its headers say), the letter page
// the one letter it shows with BodyLimit bytes of its body, the overview
// only counts: a page's peak is about one letter's size + LetterLimit ×
// (headers + BodyLimit), whatever the sizes of the bodies in the DLQ.
func (s *Server) scanLetters(ctx context.Context, q Queue, fn func(dlq.Message) bool) (int, int, error) {
	conn, err := s.amqpConn()
	if err != nil {
		return 0, 0, err
	}
	if j := s.jobs.runningFor(q.Topology.Queue); j != nil {
		return 0, 0, fmt.Errorf("a replay of %s is running (job %s): its dead letters are listed once it ends", q.Topology.Queue, j.ID)
	}
	mu := s.readLock(q.Topology.DLQ)
	mu.Lock()
	defer mu.Unlock()
	read := 0
	n, err := dlq.Scan(ctx, conn, q.Topology.DLQ, s.cfg.LetterLimit, func(m dlq.Message) bool {
		read++
		return fn(m)
	})
	if err != nil || read == 0 {
		return n, read, err
	}
	deadline := time.Now().Add(returnWait)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if st, err := dlq.Inspect(conn, q.Topology.DLQ); err != nil || st.Messages >= n {
			break
		}
		<-time.After(10 * time.Millisecond) // poll interval: the broker sends no event for it
	}
	return n, read, nil
}

// returnWait bounds the wait for the letters a read held to be back (fewer
// come back when a consumer or a replay took some meanwhile).
const returnWait = time.Second

func (s *Server) readLock(queue string) *sync.Mutex {
	s.readMu.Lock()
	defer s.readMu.Unlock()
	mu := s.reads[queue]
	if mu == nil {
		mu = &sync.Mutex{}
		s.reads[queue] = mu
	}
	return mu
}

func (s *Server) deadLetters(w http.ResponseWriter, r *http.Request) {
	q, ok := s.queueOf(w, r)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	v := deadLettersView{Queue: q.Topology.Queue, Consumer: q.Consumer, Reason: r.FormValue("reason"), ShowKeys: s.cfg.ShowKeys,
		Retention: s.cfg.KeyRetention}
	counts := reasonCounts{}
	n, read, err := s.scanLetters(ctx, q, func(m dlq.Message) bool {
		counts.add(m.Reason)
		if v.Reason == "" || m.Reason == v.Reason {
			v.Letters = append(v.Letters, s.letterView(q, m))
		}
		return true
	})
	if err != nil {
		v.Err = errText(err)
	}
	v.InQueue, v.Read, v.ByReason = n, read, counts.sorted()
	if err == nil {
		s.jobs.counts.put(q.Topology.Queue, dlqCounts{inQueue: n, read: read, byReason: v.ByReason})
	}
	s.render(w, r, http.StatusOK, "dlq", "Dead letters of "+v.Queue, v)
}

func (s *Server) letterView(q Queue, m dlq.Message) letterView {
	key, tenant, hash := s.keyScope(q).Of(m)
	if m.OriginalExchange == "" && m.OriginalRoutingKey != "" {
		m.OriginalExchange = "(default)"
	}
	v := letterView{
		ID: m.ID, Tenant: tenant, Reason: m.Reason, ByBroker: m.ByBroker, FirstSeen: m.FirstSeen, Error: m.Error,
		OriginalExchange: m.OriginalExchange, OrigKey: m.OriginalRoutingKey, BodySize: m.BodySize, Attempts: "-",
		Doomed: dlq.Doomed(m.Reason), Old: dlq.OlderThan(m.Letter, s.cfg.KeyRetention, time.Now()),
	}
	if key != "" {
		v.KeyHash = hash
		if s.cfg.ShowKeys {
			v.Key = key
		}
	}
	switch {
	case m.Attempts > 0:
		v.Attempts = strconv.Itoa(m.Attempts)
	case m.DeathCount > 0:
		v.Attempts = fmt.Sprintf("%d (x-death)", m.DeathCount)
	}
	return v
}

type headerView struct {
	Name, Value string
	Hidden      bool
}

type letterDetailView struct {
	Queue   string
	Letter  letterView
	Props   []headerView
	Headers []headerView
	Body    content
	Missing bool
}

// lettersFor reads the dead letters of the request's queue for a page that
// needs them all, calling fn with each (it renders the error page when it
// cannot).
func (s *Server) lettersFor(w http.ResponseWriter, r *http.Request, fn func(Queue, dlq.Message) bool) (Queue, bool) {
	q, ok := s.queueOf(w, r)
	if !ok {
		return q, false
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	if _, _, err := s.scanLetters(ctx, q, func(m dlq.Message) bool { return fn(q, m) }); err != nil {
		s.fail(w, r, http.StatusBadGateway, err)
		return q, false
	}
	return q, true
}

func (s *Server) letter(w http.ResponseWriter, r *http.Request) {
	id := r.FormValue("id")
	var m dlq.Message
	var view letterView
	found := false
	q, ok := s.lettersFor(w, r, func(lq Queue, l dlq.Message) bool {
		if l.ID == id && !found {
			// Its key read from the whole body (a preset may read it
			// there); one byte more than is shown kept, so that
			// showContent sees the cut.
			view, m, found = s.letterView(lq, l), l.Cut(s.cfg.BodyLimit+1), true
		}
		// On to the end: a read that stops early would send the letters
		// it read behind the others, reordering the DLQ.
		return true
	})
	if !ok {
		return
	}
	v := letterDetailView{Queue: q.Topology.Queue}
	if !found {
		v.Missing = true
		s.render(w, r, http.StatusNotFound, "letter", "Dead letter", v)
		return
	}
	v.Letter = view
	msgID := headerView{Name: "message_id", Value: m.MessageID}
	if !s.cfg.ShowKeys && m.MessageID != "" {
		msgID = headerView{Name: "message_id", Value: "key hash " + v.Letter.KeyHash, Hidden: true}
	}
	v.Props = []headerView{msgID, {Name: "content_type", Value: m.ContentType}, {Name: "routing_key (in the DLQ)", Value: m.RoutingKey}}
	if m.Timestamp != nil {
		v.Props = append(v.Props, headerView{Name: "timestamp", Value: m.Timestamp.UTC().Format(time.RFC3339)})
	}
	if m.UserID != "" {
		v.Props = append(v.Props, headerView{Name: "user_id", Value: m.UserID})
	}
	for _, name := range slices.Sorted(maps.Keys(m.Headers)) {
		h := headerView{Name: name, Value: headerValue(m.Headers[name])}
		if !s.cfg.ShowKeys && strings.EqualFold(name, s.cfg.KeyHeader) {
			h.Value, h.Hidden = "(hidden: a raw key; --show-keys shows it)", true
		}
		v.Headers = append(v.Headers, h)
	}
	v.Body = showContent(m.Body, s.cfg.BodyLimit)
	v.Body.Size = m.BodySize // the whole body's, not the part kept
	s.render(w, r, http.StatusOK, "letter", "Dead letter", v)
}

// headerValue is a header value as text, bounded.
func headerValue(v any) string {
	var s string
	switch x := v.(type) {
	case []byte:
		s = showContent(x, 256).Text
	case string:
		s = x
	default:
		s = fmt.Sprint(x)
	}
	if r := []rune(s); len(r) > 512 {
		s = string(r[:511]) + "…"
	}
	return s
}

type replayConfirmView struct {
	Queue  string
	Reason string
	Count  int
	// ForeignUserID counts the letters with a user_id the UI's broker user
	// may not publish (dlq.UserIDPolicy): the page offers to drop it.
	ForeignUserID int
	// Doomed counts the letters whose reason cannot succeed unchanged, with
	// why by reason; Old those older than the key retention (Retention).
	// Unless the operator ticks their box, they stay in the DLQ.
	Doomed    int
	DoomedWhy []reasonWhy
	Old       int
	Retention time.Duration
	IDs       []string
	Letters   []letterView
	Token     string
}

// reasonWhy is a reason whose letters cannot succeed unchanged, and why.
type reasonWhy struct{ Reason, Why string }

// replayConfirm shows what a replay will move, and the button that does it.
func (s *Server) replayConfirm(w http.ResponseWriter, r *http.Request) {
	reason := r.PostFormValue("reason")
	ids := r.PostForm["id"]
	if len(ids) == 0 && reason == "" {
		s.fail(w, r, http.StatusBadRequest, errors.New("choose dead letters, or a reason, to replay"))
		return
	}
	want := map[string]bool{}
	for _, id := range ids {
		want[id] = true
	}
	if len(ids) > 0 {
		reason = ""
	}
	v := replayConfirmView{Reason: reason, Retention: s.cfg.KeyRetention}
	doomed := map[string]string{}
	user := ""
	if conn, err := s.amqpConn(); err == nil {
		user = dlq.User(conn)
	}
	q, ok := s.lettersFor(w, r, func(q Queue, m dlq.Message) bool {
		switch {
		case len(ids) > 0 && want[m.ID]:
			v.IDs = append(v.IDs, m.ID)
			delete(want, m.ID)
		case len(ids) > 0 || m.Reason != reason:
			return true
		}
		l := s.letterView(q, m)
		v.Letters = append(v.Letters, l)
		if !wire.UserIDAllowed(m.UserID, user) {
			v.ForeignUserID++
		}
		if l.Doomed != "" {
			v.Doomed++
			doomed[l.Reason] = l.Doomed
		}
		if l.Old {
			v.Old++
		}
		return true
	})
	if !ok {
		return
	}
	for _, r := range slices.Sorted(maps.Keys(doomed)) {
		v.DoomedWhy = append(v.DoomedWhy, reasonWhy{r, doomed[r]})
	}
	v.Queue, v.Token = q.Topology.Queue, s.ops.issue()
	v.Count = len(v.Letters)
	if v.Count == 0 {
		s.fail(w, r, http.StatusConflict, errors.New("none of the chosen dead letters is in the DLQ any more (replayed by someone else?)"))
		return
	}
	s.render(w, r, http.StatusOK, "replay_confirm", "Replay dead letters?", v)
}

// replay starts the replay that a confirmation page describes, and sends the
// browser to its progress page.
func (s *Server) replay(w http.ResponseWriter, r *http.Request) {
	q, ok := s.queueOf(w, r)
	if !ok {
		return
	}
	token := r.PostForm.Get("once")
	if prev, ok := s.ops.use(token); !ok {
		err := errors.New("this replay was already submitted (or its confirmation page expired): nothing was done again")
		if prev != "" {
			err = fmt.Errorf("this replay was already submitted, as job %s: nothing was done again", prev)
		}
		s.fail(w, r, http.StatusConflict, err)
		return
	}
	reason := r.PostForm.Get("reason")
	count, _ := strconv.Atoi(r.PostForm.Get("count"))
	opts := dlq.ReplayOptions{Queue: q.Topology.DLQ, Target: q.Topology.Queue, Logger: s.log, Retention: s.cfg.KeyRetention,
		// The operator ticked these on the confirmation page.
		Doomed: r.PostForm.Get("doomed") == "1", OlderThanRetention: r.PostForm.Get("older") == "1"}
	if r.PostForm.Get("drop_user_id") == "1" {
		opts.UserID = dlq.UserIDDrop
	}
	what := ""
	if ids := r.PostForm["id"]; len(ids) > 0 {
		// Each chosen letter once, even when two share an id.
		want := map[string]int{}
		for _, id := range ids {
			want[id] = 1
		}
		opts.Select = func(id string, _ wire.Letter) bool {
			if want[id] > 0 {
				want[id]--
				return true
			}
			return false
		}
		// Done once every chosen letter is replayed.
		opts.Limit = len(want)
		what = fmt.Sprintf("%d chosen dead letter(s)", len(want))
	} else if reason != "" && count > 0 {
		// At most as many as the operator saw and confirmed.
		opts.Reason, opts.Limit = reason, count
		what = fmt.Sprintf("up to %d dead letter(s) with reason %s", count, reason)
	} else {
		s.fail(w, r, http.StatusBadRequest, errors.New("nothing to replay"))
		return
	}
	conn, err := s.amqpConn()
	if err != nil {
		s.fail(w, r, http.StatusBadGateway, err)
		return
	}
	if j := s.jobs.runningFor(q.Topology.Queue); j != nil {
		s.fail(w, r, http.StatusConflict, fmt.Errorf("%w (job %s): wait for it to end", errBusy, j.ID))
		return
	}
	// Recorded before it starts: a replay that cannot be recorded does not run.
	entry, err := s.begin(r.Context(), r, audit.ActionReplay, q.Topology.Queue, what)
	if err != nil {
		s.fail(w, r, http.StatusServiceUnavailable, err)
		return
	}
	var digests []string
	opts.Replayed = func(d *amqp.Delivery) {
		if key, _, _ := s.keyScope(q).OfDelivery(d); key != "" {
			digests = append(digests, audit.KeyDigest(key))
		}
	}
	j, err := s.jobs.start(q.Topology.Queue, what, func(ctx context.Context, j *job) error {
		opts.Start = func(total int) {
			j.mu.Lock()
			j.total = total // the letters Replay reads at most
			j.mu.Unlock()
		}
		opts.Progress = func(res dlq.ReplayResult) {
			j.mu.Lock()
			j.progress(res)
			j.mu.Unlock()
		}
		// The pages' reads would hide letters from the replay: they wait.
		mu := s.readLock(q.Topology.DLQ)
		mu.Lock()
		defer mu.Unlock()
		res, err := dlq.Replay(ctx, conn, opts)
		j.mu.Lock()
		j.progress(res)
		j.interrupted = res.Interrupted
		j.mu.Unlock()
		s.log.Info("ui: replay", "queue", q.Topology.Queue, "replayed", res.Replayed, "skipped", res.Skipped,
			"doomed", res.Doomed, "older_than_retention", res.Old,
			"user_id_dropped", res.UserIDDropped, "user_id_refused", res.UserIDRefused, "err", errText(err))
		if errors.Is(err, dlq.ErrOlderThanRetention) && !errors.Is(err, dlq.ErrForeignUserID) {
			// Left as the operator chose (the box not ticked): counted, not a failure.
			err = nil
		}
		if err == nil && res.Interrupted {
			s.end(entry, res.Replayed, audit.ErrInterrupted, digests)
		} else {
			s.end(entry, res.Replayed, err, digests)
		}
		return err
	})
	if err != nil {
		s.end(entry, 0, err, nil)
	}
	if errors.Is(err, errBusy) {
		s.fail(w, r, http.StatusConflict, fmt.Errorf("%w (job %s): wait for it to end", err, j.ID))
		return
	}
	if err != nil {
		s.fail(w, r, http.StatusServiceUnavailable, err)
		return
	}
	s.ops.record(token, j.ID)
	http.Redirect(w, r, "/jobs?id="+url.QueryEscape(j.ID), http.StatusSeeOther)
}

func (s *Server) job(w http.ResponseWriter, r *http.Request) {
	j := s.jobs.get(r.FormValue("id"))
	if j == nil {
		s.fail(w, r, http.StatusNotFound, errors.New("no such replay (the UI was restarted?)"))
		return
	}
	st := j.state()
	refresh := time.Duration(0)
	if !st.Done {
		refresh = time.Second
	}
	s.renderRefresh(w, r, http.StatusOK, "job", "Replay of "+st.Queue, st, refresh)
}
