package demo

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/cmd/idemq/internal/gateway"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/idemhttp"
	"github.com/idemq/idemq/outbox"
)

// The HTTP part's fixed settings.
const (
	// gatewayConsumer scopes the gateway's keys; the workers claim the same
	// keys again, as message_id, under consumerName.
	gatewayConsumer = "payments-api"
	// httpKeyPrefix marks the HTTP part's keys in the ledger.
	httpKeyPrefix = "http-"
	// httpClients send the operations, each one at a time.
	httpClients = 16
	// clientTimeout is how long a client waits for an answer before it
	// gives up and sends the same key again: the endless spinner.
	clientTimeout = 400 * time.Millisecond
	// slowFor is how long a slow operation takes (a card network that
	// answers late).
	slowFor = 1200 * time.Millisecond
	// maxHTTPAttempts bounds one operation's attempts.
	maxHTTPAttempts = 30
)

// The share of operations, in percent, for each kind of trouble (decided
// from a hash of the key).
const (
	slowPercent        = 25 // the first run takes slowFor: the client times out, retries, gets 409
	lostAnswerPercent  = 15 // the answer is lost after the commit: the client retries, gets the replay
	doubleClickPercent = 10 // two submissions at once
)

// HTTPReport is the HTTP part's outcome: clients that time out and retry
// the same key → the gateway → RabbitMQ → the workers → the ledger.
type HTTPReport struct {
	// Operations counts the unique operations (keys); Slow, LostAnswers
	// and DoubleClicks count those that met each kind of trouble.
	Operations, Slow, LostAnswers, DoubleClicks int
	// Attempts counts HTTP requests sent; the rest split them by answer.
	// Lost counts answers lost on the way back (the client retried).
	Attempts, Accepted, Replayed, Conflicts, Timeouts, Lost, OtherAnswers int
	// Published counts the gateway's outbox rows the relay published.
	Published int
	// Charges counts the ledger rows of the HTTP keys, ChargedKeys their
	// distinct keys, DoubledKeys the keys charged more than once.
	Charges, ChargedKeys, DoubledKeys int
	Elapsed                           time.Duration
	Failures                          []string
}

// httpOp is one operation a client performs.
type httpOp struct {
	key  string
	body []byte
	trouble
}

type trouble struct{ slow, lostAnswer, doubleClick bool }

func troubleOf(key string) trouble {
	h := fnv.New32a()
	h.Write([]byte(key))
	n := int((h.Sum32() >> 8) % 100)
	return trouble{
		slow:        n < slowPercent,
		lostAnswer:  n >= slowPercent && n < slowPercent+lostAnswerPercent,
		doubleClick: n >= slowPercent+lostAnswerPercent && n < slowPercent+lostAnswerPercent+doubleClickPercent,
	}
}

// runHTTP runs the HTTP part: workers consume again, a gateway publishes
// into the work queue, clients send the operations and retry as a browser
// or a client library would; then it waits until every operation is
// charged and counts.
func (r *runner) runHTTP(ctx context.Context) (*HTTPReport, error) {
	o := r.o
	start := time.Now()
	rep := &HTTPReport{Operations: o.HTTPPayments}
	fmt.Fprintf(r.w, "\nidemq demo, the HTTP front door: %d payments POSTed to idemq gateway by %d clients that give up after %s and retry the same key\n",
		o.HTTPPayments, httpClients, clientTimeout)

	pool, err := newPool(ctx, o.PostgresURL, 2*httpClients+8, "idemq-demo-gateway", false)
	if err != nil {
		return nil, fmt.Errorf("demo: %w", err)
	}
	defer pool.Close()
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: o.Schema, Lease: lease})
	if err != nil {
		return nil, fmt.Errorf("demo: %w", err)
	}
	logFile, err := os.Create(filepath.Join(r.logDir, "gateway.log"))
	if err != nil {
		return nil, fmt.Errorf("demo: gateway log: %w", err)
	}
	defer logFile.Close()
	log := slog.New(slog.NewTextHandler(logFile, nil))

	// The slow card network: the first run of a slow operation's key takes
	// slowFor, inside the key's lease.
	var ran sync.Map
	around := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			key := req.Header.Get(idemhttp.DefaultHeader)
			if _, again := ran.LoadOrStore(key, true); !again && troubleOf(key).slow {
				time.Sleep(slowFor)
			}
			next.ServeHTTP(w, req)
		})
	}
	g, err := gateway.New(store, gateway.Config{
		Consumer: gatewayConsumer, Exchange: "", RoutingKey: o.Queue, AMQPURL: o.AMQPURL,
		Relay:  outbox.RelayConfig{ConnectionName: "idemq-demo-gateway-relay", Logger: log},
		Around: around, Logger: log,
	})
	if err != nil {
		return nil, fmt.Errorf("demo: %w", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("demo: gateway: %w", err)
	}
	gctx, stopGateway := context.WithCancel(ctx)
	defer stopGateway()
	served := make(chan error, 1)
	go func() { served <- g.Serve(gctx, ln) }()
	fmt.Fprintf(r.w, "  gateway   http://%s/messages → the default exchange → %s; slow network %d%%, answers lost after commit %d%%, double clicks %d%%\n",
		ln.Addr(), o.Queue, slowPercent, lostAnswerPercent, doubleClickPercent)

	for range o.Workers {
		if err := r.startWorker(); err != nil {
			return nil, err
		}
	}
	if err := r.waitConsumers(ctx, o.Workers); err != nil {
		return nil, err
	}

	ops := httpOps(o.HTTPPayments, o.Seed)
	for _, op := range ops {
		switch {
		case op.slow:
			rep.Slow++
		case op.lostAnswer:
			rep.LostAnswers++
		case op.doubleClick:
			rep.DoubleClicks++
		}
	}
	var tally httpTally
	lossy := &lossyTransport{next: http.DefaultTransport}
	base := "http://" + ln.Addr().String()
	work := make(chan httpOp)
	var wg sync.WaitGroup
	var failed atomic.Int64
	for range httpClients {
		wg.Go(func() {
			c := &http.Client{Timeout: clientTimeout, Transport: lossy}
			for op := range work {
				if !tally.operate(ctx, c, base, op) {
					failed.Add(1)
				}
			}
		})
	}
	done := 0
	for _, op := range ops {
		select {
		case work <- op:
		case <-ctx.Done():
		}
		done++
		if done%20 == 0 || done == len(ops) {
			r.prog.update(fmt.Sprintf("%s sent %d/%d operations · attempts %d · 409 %d · replayed %d · timeouts %d",
				bar(done, len(ops)), done, len(ops), tally.attempts.Load(), tally.conflicts.Load(), tally.replayed.Load(), tally.timeouts.Load()), false)
		}
	}
	close(work)
	wg.Wait()
	// Stopping the gateway flushes its outbox to the broker.
	stopGateway()
	if err := <-served; err != nil {
		return nil, fmt.Errorf("demo: gateway: %w", err)
	}
	if ctx.Err() != nil {
		return nil, fmt.Errorf("demo: interrupted: %w", ctx.Err())
	}
	settleErr := r.settleHTTP(ctx, o.HTTPPayments)
	r.prog.end()
	r.stopWorkers()

	rep.Attempts, rep.Accepted, rep.Replayed = int(tally.attempts.Load()), int(tally.accepted.Load()), int(tally.replayed.Load())
	rep.Conflicts, rep.Timeouts, rep.Lost, rep.OtherAnswers = int(tally.conflicts.Load()), int(tally.timeouts.Load()), int(tally.lost.Load()), int(tally.other.Load())
	s := pgx.Identifier{o.Schema}.Sanitize()
	err = r.pool.QueryRow(ctx, `SELECT
    (SELECT count(*) FROM `+s+`.charges WHERE key LIKE $1),
    (SELECT count(DISTINCT key) FROM `+s+`.charges WHERE key LIKE $1),
    (SELECT count(*) FROM (SELECT key FROM `+s+`.charges WHERE key LIKE $1 GROUP BY key HAVING count(*) > 1) d),
    (SELECT count(*) FROM `+s+`.outbox_published WHERE message_id LIKE $1)`, httpKeyPrefix+"%").
		Scan(&rep.Charges, &rep.ChargedKeys, &rep.DoubledKeys, &rep.Published)
	if err != nil {
		return nil, fmt.Errorf("demo: HTTP report: %w", err)
	}
	rep.Elapsed = time.Since(start)
	if settleErr != nil {
		rep.Failures = append(rep.Failures, settleErr.Error())
	}
	if n := failed.Load(); n > 0 {
		rep.Failures = append(rep.Failures, fmt.Sprintf("%d operations never got a 202", n))
	}
	rep.check()
	return rep, nil
}

// httpOps lays out n payments, each under a key of its own.
func httpOps(n int, seed int64) []httpOp {
	rng := rand.New(rand.NewPCG(uint64(seed), 0x1de3_4779))
	ops := make([]httpOp, n)
	for i := range ops {
		key := fmt.Sprintf("%s%d-%d", httpKeyPrefix, seed, i)
		body, _ := json.Marshal(payment{
			Account:  fmt.Sprintf("acct-%04d", rng.IntN(500)),
			Amount:   100 + rng.Int64N(balanceLimit-100),
			Currency: "EUR",
			Network:  networks[rng.IntN(len(networks))],
		})
		ops[i] = httpOp{key: key, body: body, trouble: troubleOf(key)}
	}
	return ops
}

// httpTally counts the answers the clients got.
type httpTally struct {
	attempts, accepted, replayed, conflicts, timeouts, lost, other atomic.Int64
}

// operate sends op until it is accepted, as a client that retries the same
// key would: after a timeout at once, after a 409 when Retry-After says.
// A double click sends the first attempt twice at once. It reports whether
// the operation got its 202.
func (t *httpTally) operate(ctx context.Context, c *http.Client, base string, op httpOp) bool {
	if op.doubleClick {
		var wg sync.WaitGroup
		var ok atomic.Bool
		for range 2 {
			wg.Go(func() {
				if _, accepted := t.attempt(ctx, c, base, op); accepted {
					ok.Store(true)
				}
			})
		}
		wg.Wait()
		if ok.Load() {
			return true
		}
	}
	for range maxHTTPAttempts {
		wait, accepted := t.attempt(ctx, c, base, op)
		if accepted {
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(wait):
		}
	}
	return false
}

// attempt sends op once and returns how long to wait before the next.
func (t *httpTally) attempt(ctx context.Context, c *http.Client, base string, op httpOp) (wait time.Duration, accepted bool) {
	t.attempts.Add(1)
	req, err := http.NewRequestWithContext(ctx, "POST", base+"/messages", bytes.NewReader(op.body))
	if err != nil {
		t.other.Add(1)
		return time.Second, false
	}
	req.Header.Set(idemhttp.DefaultHeader, op.key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if errors.Is(err, errAnswerLost) {
		t.lost.Add(1)
		return 50 * time.Millisecond, false
	}
	if err != nil {
		t.timeouts.Add(1)
		return 50 * time.Millisecond, false
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	switch {
	case resp.StatusCode == http.StatusAccepted && resp.Header.Get(idemhttp.ReplayedHeader) == "true":
		t.replayed.Add(1)
		return 0, true
	case resp.StatusCode == http.StatusAccepted:
		t.accepted.Add(1)
		return 0, true
	case resp.StatusCode == http.StatusConflict:
		t.conflicts.Add(1)
		if s, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && s > 0 {
			return time.Duration(s) * time.Second, false
		}
		return time.Second, false
	}
	t.other.Add(1)
	return 200 * time.Millisecond, false
}

// lossyTransport loses the first answer of the lost-answer operations: the
// gateway has committed and answered, but the answer never reaches the
// client, as when a connection drops on the way back. The client sees a
// failed request.
type lossyTransport struct {
	next http.RoundTripper
	seen sync.Map
}

var errAnswerLost = errors.New("the answer was lost on the way back")

func (t *lossyTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := t.next.RoundTrip(req)
	key := req.Header.Get(idemhttp.DefaultHeader)
	if err != nil || !troubleOf(key).lostAnswer {
		return resp, err
	}
	if _, again := t.seen.LoadOrStore(key, true); again {
		return resp, nil
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return nil, errAnswerLost
}

// settleHTTP waits until every HTTP key is completed by the workers and the
// queues are empty.
func (r *runner) settleHTTP(ctx context.Context, n int) error {
	s := pgx.Identifier{r.o.Schema}.Sanitize()
	deadline := time.Now().Add(r.o.Timeout)
	for {
		var completed, leased int
		err := r.pool.QueryRow(ctx, `SELECT
    (SELECT count(*) FROM `+s+`.keys WHERE consumer = $1 AND key LIKE $2 AND state = 'completed'),
    (SELECT count(*) FROM `+s+`.keys WHERE state = 'in_progress' AND locked_until > now())`,
			consumerName, httpKeyPrefix+"%").Scan(&completed, &leased)
		st, qerr := r.insp.state()
		r.prog.update(fmt.Sprintf("%s charged %d/%d operations · queued %d · retrying %d", bar(completed, n), completed, n, st.Ready, st.Retrying), false)
		if err == nil && qerr == nil && completed >= n && leased == 0 && st.Ready == 0 && st.Retrying == 0 {
			r.prog.update(fmt.Sprintf("%s charged %d/%d operations", bar(completed, n), completed, n), true)
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d of %d HTTP operations completed by the workers within %s (db: %v, broker: %v)", completed, n, r.o.Timeout, err, qerr)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("demo: interrupted: %w", ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// check fills Failures with every broken part of the HTTP invariant:
// charges == unique operations, none doubled, one message per key.
func (h *HTTPReport) check() {
	if h.Charges != h.Operations {
		h.Failures = append(h.Failures, fmt.Sprintf("HTTP: %d charges for %d unique operations", h.Charges, h.Operations))
	}
	if h.DoubledKeys > 0 {
		h.Failures = append(h.Failures, fmt.Sprintf("HTTP: %d keys charged more than once", h.DoubledKeys))
	}
	if h.Published != h.Operations {
		h.Failures = append(h.Failures, fmt.Sprintf("HTTP: the gateway published %d messages for %d operations", h.Published, h.Operations))
	}
	if h.Accepted+h.Replayed < h.Operations {
		h.Failures = append(h.Failures, fmt.Sprintf("HTTP: %d operations accepted", h.Accepted+h.Replayed))
	}
}

// print writes the HTTP part of the report.
func (h *HTTPReport) print(w io.Writer) {
	line := func(label string, format string, args ...any) {
		fmt.Fprintf(w, "  %-*s %s\n", reportIndent-3, label, fmt.Sprintf(format, args...))
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "HTTP front door (clients → idemq gateway → RabbitMQ → workers → ledger)")
	line("unique operations", "%d (%d on a slow network, %d answers lost after commit, %d double clicks)", h.Operations, h.Slow, h.LostAnswers, h.DoubleClicks)
	line("HTTP attempts", "%d", h.Attempts)
	line("  202 accepted", "%d (answered by the request that enqueued the message)", h.Accepted)
	line("  202 replayed", "%d (Idempotent-Replayed: true; nothing enqueued again)", h.Replayed)
	line("  409 in progress", "%d (Retry-After; the first request still held the key)", h.Conflicts)
	line("  client timeouts", "%d (gave up after %s and sent the same key again)", h.Timeouts, clientTimeout)
	line("  answers lost", "%d (committed and answered, never read: the client sent the key again)", h.Lost)
	if h.OtherAnswers > 0 {
		line("  other answers", "%d", h.OtherAnswers)
	}
	line("messages published", "%d (one per key, message_id = the key)", h.Published)
	line("charges", "%d card charges for %d unique operations (%d keys charged twice)", h.Charges, h.Operations, h.DoubledKeys)
	line("elapsed", "%s", h.Elapsed.Round(100*time.Millisecond))
}
