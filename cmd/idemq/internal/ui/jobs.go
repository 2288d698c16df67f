package ui

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"sync"
	"time"

	"github.com/idemq/idemq/cmd/idemq/internal/dlq"
)

// job is one replay running in the background, whose page shows its progress.
type job struct {
	ID, Queue, What string
	Started         time.Time

	mu                    sync.Mutex
	total, read, replayed int
	skipped               int
	// userIDDropped and userIDRefused count the letters replayed without
	// their user_id, and those left in the DLQ for it (dlq.UserIDPolicy).
	userIDDropped, userIDRefused int
	// doomed and old count the letters left for their reason, and for their age.
	doomed, old       int
	done, interrupted bool
	err               string
	finished          time.Time
}

// jobState is a job's progress as its page shows it.
type jobState struct {
	ID, Queue, What                string
	Total, Read, Replayed, Skipped int
	UserIDDropped, UserIDRefused   int
	Doomed, Old                    int
	Done, Interrupted              bool
	Err                            string
	Started, Finished              time.Time
}

func (j *job) state() jobState {
	j.mu.Lock()
	defer j.mu.Unlock()
	return jobState{ID: j.ID, Queue: j.Queue, What: j.What, Total: j.total, Read: j.read, Replayed: j.replayed,
		Skipped: j.skipped, UserIDDropped: j.userIDDropped, UserIDRefused: j.userIDRefused, Doomed: j.doomed, Old: j.old, Done: j.done, Interrupted: j.interrupted, Err: j.err, Started: j.Started, Finished: j.finished}
}

// progress records the counts of a replay; j.mu is held.
func (j *job) progress(res dlq.ReplayResult) {
	j.read, j.replayed, j.userIDDropped, j.userIDRefused = res.Read, res.Replayed, res.UserIDDropped, res.UserIDRefused
	j.doomed, j.old = res.Doomed, res.Old
	j.skipped = res.Read - res.Replayed - res.Doomed - res.Old // not chosen, or left for their user_id
}

// jobs are the replays started: at most one running per queue, so that two
// operators (or one who clicks twice) never replay the same letters at once.
type jobs struct {
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	byID    map[string]*job
	running map[string]*job // by queue

	// counts are the overview's counts of each DLQ by reason, kept here
	// because a replay, which changes them, forgets them when it starts
	// and when it ends.
	counts countCache
}

func newJobs() *jobs {
	ctx, cancel := context.WithCancel(context.Background())
	return &jobs{ctx: ctx, cancel: cancel, byID: map[string]*job{}, running: map[string]*job{}}
}

// jobsKept is how long a finished job's page stays.
const jobsKept = 24 * time.Hour

// errBusy means a replay of the queue is already running.
var errBusy = errors.New("a replay of this queue is already running")

// start runs fn as the queue's job, unless one is running (errBusy, with it).
func (js *jobs) start(queue, what string, fn func(ctx context.Context, j *job) error) (*job, error) {
	js.mu.Lock()
	defer js.mu.Unlock()
	if j := js.running[queue]; j != nil {
		return j, errBusy
	}
	if js.ctx.Err() != nil {
		return nil, errors.New("the UI is stopping")
	}
	for id, old := range js.byID {
		if st := old.state(); st.Done && time.Since(st.Finished) > jobsKept {
			delete(js.byID, id)
		}
	}
	j := &job{ID: randomID(), Queue: queue, What: what, Started: time.Now()}
	js.byID[j.ID], js.running[queue] = j, j
	js.counts.forget(queue)
	js.wg.Go(func() {
		err := fn(js.ctx, j)
		js.counts.forget(queue)
		j.mu.Lock()
		j.done, j.finished = true, time.Now()
		if err != nil {
			j.err = errText(err)
		}
		j.mu.Unlock()
		js.mu.Lock()
		delete(js.running, queue)
		js.mu.Unlock()
	})
	return j, nil
}

// runningFor returns the job running for queue, nil when none is.
func (js *jobs) runningFor(queue string) *job {
	js.mu.Lock()
	defer js.mu.Unlock()
	return js.running[queue]
}

func (js *jobs) get(id string) *job {
	js.mu.Lock()
	defer js.mu.Unlock()
	return js.byID[id]
}

// stop ends the jobs (each after the message in hand) and waits for them,
// at most until ctx ends.
func (js *jobs) stop(ctx context.Context) {
	js.cancel()
	done := make(chan struct{})
	go func() { js.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
	}
}

func randomID() string {
	b := make([]byte, 12)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// onceTokens are the tokens of confirmation pages: each lets one change
// through, so that a form sent twice (a reload, a double click) is refused
// the second time.
type onceTokens struct {
	mu     sync.Mutex
	issued map[string]time.Time
	used   map[string]string // token → the job it started, "" when none
}

// onceTTL is how long a confirmation page stays valid.
const onceTTL = time.Hour

func newOnceTokens() *onceTokens {
	return &onceTokens{issued: map[string]time.Time{}, used: map[string]string{}}
}

func (o *onceTokens) issue() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	now := time.Now()
	for t, at := range o.issued {
		if now.Sub(at) > onceTTL {
			delete(o.issued, t)
		}
	}
	if len(o.used) > 10000 {
		o.used = map[string]string{}
	}
	t := randomID()
	o.issued[t] = now
	return t
}

// use spends token; it reports false (with what the first use recorded)
// when the token was spent before or never issued.
func (o *onceTokens) use(token string) (string, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if _, ok := o.issued[token]; !ok {
		return o.used[token], false
	}
	delete(o.issued, token)
	o.used[token] = ""
	return "", true
}

// record notes what a spent token did (the job it started).
func (o *onceTokens) record(token, what string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.used[token] = what
}
