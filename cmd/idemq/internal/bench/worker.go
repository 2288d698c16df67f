package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime/pprof"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/amqpdial"
)

// workerEnv carries a worker's spec to the re-executed binary.
const workerEnv = "IDEMQ_BENCH_WORKER"

// headerSent carries the publish time (Unix nanoseconds) of paced messages.
const headerSent = "x-bench-sent"

// mode is how a worker consumes.
type mode string

const (
	modeBare  mode = "bare"  // amqp091-go consume + ack, nothing else
	modeIdemq mode = "idemq" // idemq, in the workerSpec's Consumer mode

	// The publishing side.
	modePublish mode = "publish" // bare publisher with confirms, a window of them outstanding
	modeRelay   mode = "relay"   // idemq's outbox relay draining a preloaded outbox
	modePipe    mode = "pipe"    // bare consume, publish with confirm, ack
	modeForward mode = "forward" // idemq forward: consume, claim, outbox, relay

	// The HTTP front door: a server (workerSpec.Server) until stdin ends.
	modeHTTP mode = "http"
)

// workerSpec is what one worker process runs.
type workerSpec struct {
	Mode        mode          `json:"mode"`
	PostgresURL string        `json:"postgres_url"`
	AMQPURL     string        `json:"amqp_url"`
	Schema      string        `json:"schema"`
	Queue       string        `json:"queue"`
	Count       int           `json:"count"`
	MaxDuration time.Duration `json:"max_duration"`
	Concurrency int           `json:"concurrency"`
	Prefetch    int           `json:"prefetch"`
	GroupSize   int           `json:"group_size"`
	// Consumer is the mode an idemq worker runs (consumer.Mode.Apply).
	Consumer consumer.Mode `json:"consumer,omitempty"`
	// Partitions, when set, consumes a partitioned queue, ordered.
	Partitions int           `json:"partitions,omitempty"`
	Linger     time.Duration `json:"linger,omitempty"`
	// Publishing side: the queue published to, the body size, the
	// publisher's confirm window, the relay's batch size.
	Target    string `json:"target,omitempty"`
	BodySize  int    `json:"body_size,omitempty"`
	Window    int    `json:"window,omitempty"`
	BatchSize int    `json:"batch_size,omitempty"`
	// Server is what an HTTP worker serves.
	Server httpServer `json:"server,omitempty"`
}

// workerResult is what a worker prints on stdout.
type workerResult struct {
	Settled     int     `json:"settled"`
	FirstToLast int64   `json:"first_to_last_ns"`
	Latencies   []int64 `json:"latencies_ns,omitempty"`
	Error       string  `json:"error,omitempty"`
	// Note is what to know about the figure (not an error).
	Note string `json:"note,omitempty"`
}

// runWorker is the body of a worker process.
func runWorker(ctx context.Context, specJSON string, out io.Writer) error {
	var spec workerSpec
	if err := json.Unmarshal([]byte(specJSON), &spec); err != nil {
		return fmt.Errorf("bench worker: spec: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, spec.MaxDuration+30*time.Second)
	defer cancel()
	var res workerResult
	var err error
	switch spec.Mode {
	case modeBare:
		res, err = runBare(ctx, spec)
	case modePublish:
		res, err = runPublisher(ctx, spec)
	case modeRelay:
		res, err = runRelay(ctx, spec)
	case modePipe:
		res, err = runPipe(ctx, spec)
	case modeForward:
		res, err = runForward(ctx, spec)
	case modeHTTP:
		res, err = runHTTPServer(ctx, spec, os.Stdin, out)
	default:
		res, err = runIdemq(ctx, spec)
	}
	if err != nil {
		res.Error = err.Error()
	}
	return json.NewEncoder(out).Encode(res)
}

// tally counts settled deliveries and stops the run at Count or MaxDuration.
type tally struct {
	count    int
	settled  atomic.Int64
	first    atomic.Int64
	last     atomic.Int64
	done     chan struct{}
	doneOnce sync.Once
	mu       sync.Mutex
	lat      []int64
}

func newTally(count int) *tally { return &tally{count: count, done: make(chan struct{})} }

func (t *tally) delivered() {
	t.first.CompareAndSwap(0, time.Now().UnixNano())
}

// start sets the start of the measurement now (for rows measured from the
// worker's start rather than from a first delivery).
func (t *tally) start() { t.first.Store(time.Now().UnixNano()) }

// settleN settles n messages without headers.
func (t *tally) settleN(n int64) {
	t.last.Store(time.Now().UnixNano())
	if int(t.settled.Add(n)) >= t.count {
		t.doneOnce.Do(func() { close(t.done) })
	}
}

func (t *tally) settle(headers amqp.Table) {
	now := time.Now().UnixNano()
	if sent, ok := sentAt(headers); ok {
		t.mu.Lock()
		t.lat = append(t.lat, now-sent)
		t.mu.Unlock()
	}
	t.last.Store(now)
	if int(t.settled.Add(1)) >= t.count {
		t.doneOnce.Do(func() { close(t.done) })
	}
}

func (t *tally) result() workerResult {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := workerResult{Settled: int(t.settled.Load()), Latencies: t.lat}
	if f, l := t.first.Load(), t.last.Load(); f > 0 && l > f {
		r.FirstToLast = l - f
	}
	return r
}

func (t *tally) wait(ctx context.Context, limit time.Duration) {
	select {
	case <-t.done:
	case <-time.After(limit):
	case <-ctx.Done():
	}
}

func sentAt(h amqp.Table) (int64, bool) {
	switch v := h[headerSent].(type) {
	case int64:
		return v, true
	case string:
		n, err := strconv.ParseInt(v, 10, 64)
		return n, err == nil
	}
	return 0, false
}

func runBare(ctx context.Context, spec workerSpec) (workerResult, error) {
	conn, err := amqpdial.DialURL(ctx, spec.AMQPURL, "idemq-bench", 0)
	if err != nil {
		return workerResult{}, err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return workerResult{}, err
	}
	if err := ch.Qos(spec.Prefetch, 0, false); err != nil {
		return workerResult{}, err
	}
	ds, err := ch.Consume(spec.Queue, "", false, false, false, false, nil)
	if err != nil {
		return workerResult{}, err
	}
	t := newTally(spec.Count)
	go func() {
		for d := range ds {
			t.delivered()
			if err := d.Ack(false); err != nil {
				return
			}
			t.settle(d.Headers)
		}
	}()
	t.wait(ctx, spec.MaxDuration)
	return t.result(), nil
}

// openStore opens a pool of maxConns connections and the key store of
// spec's schema on it; close closes the pool.
func openStore(ctx context.Context, spec workerSpec, maxConns int) (store *dedup.Store, close func(), err error) {
	pcfg, err := pgxpool.ParseConfig(spec.PostgresURL)
	if err != nil {
		return nil, nil, err
	}
	pcfg.MaxConns = int32(maxConns)
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, nil, err
	}
	store, err = dedup.NewStore(pool, &dedup.Config{Schema: spec.Schema})
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	return store, pool.Close, nil
}

func runIdemq(ctx context.Context, spec workerSpec) (workerResult, error) {
	store, closePool, err := openStore(ctx, spec, 2*spec.Concurrency+2)
	if err != nil {
		return workerResult{}, err
	}
	defer closePool()
	t := newTally(spec.Count)
	ledger := pgx.Identifier{spec.Schema, "ledger"}.Sanitize()
	effect := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		t.delivered()
		_, err := tx.Exec(ctx, "INSERT INTO "+ledger+" (key) VALUES ($1)", d.Key)
		return consumer.Response{}, err
	}
	var sentMu sync.Mutex
	sent := map[string]amqp.Table{} // key hash → headers of paced messages
	cfg := &consumer.Config{
		URL: spec.AMQPURL, Queue: spec.Queue, Name: "bench", SkipDeclare: true,
		Concurrency: spec.Concurrency, Prefetch: spec.Prefetch, Group: consumer.Group{Size: spec.GroupSize},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		OnOutcome: func(e consumer.Event) {
			sentMu.Lock()
			h := sent[e.KeyHash]
			delete(sent, e.KeyHash)
			sentMu.Unlock()
			if e.Outcome == consumer.OutcomeWaiting {
				return // it runs again when its turn comes
			}
			if e.Outcome == consumer.OutcomeDuplicate {
				t.delivered()
			}
			t.settle(h)
		},
	}
	track := func(d *consumer.Delivery) {
		if _, ok := d.Headers[headerSent]; ok {
			sentMu.Lock()
			sent[dedup.Scope{Consumer: "bench", Tenant: d.Tenant, Key: d.Key}.KeyHash()] = d.Headers
			sentMu.Unlock()
		}
	}
	spec.Consumer.Apply(cfg)
	if spec.Partitions > 0 {
		cfg.Partitions, cfg.Ordering = spec.Partitions, &consumer.Ordering{}
	}
	cfg.Group.Size = spec.GroupSize
	cfg.Group.Linger = spec.Linger
	if v := os.Getenv("IDEMQ_BENCH_LINGER"); v != "" {
		cfg.Group.Linger, _ = time.ParseDuration(v)
	}
	// IDEMQ_BENCH_INDIVIDUAL_ACKS=1 measures the consumer with one ack frame
	// per delivery (Config.IndividualAcks).
	cfg.IndividualAcks = os.Getenv("IDEMQ_BENCH_INDIVIDUAL_ACKS") == "1"
	var c *consumer.Consumer
	if spec.Consumer.Batch() {
		c, err = consumer.NewBatch(store, func(ctx context.Context, tx pgx.Tx, ds []*consumer.Delivery) ([]consumer.Response, error) {
			keys := make([]string, len(ds))
			for i, d := range ds {
				track(d)
				t.delivered()
				keys[i] = d.Key
			}
			_, err := tx.Exec(ctx, "INSERT INTO "+ledger+" (key) SELECT unnest($1::text[])", keys)
			return make([]consumer.Response, len(ds)), err
		}, cfg)
	} else {
		c, err = consumer.New(store, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			track(d)
			return effect(ctx, tx, d)
		}, cfg)
	}
	if err != nil {
		return workerResult{}, err
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	t.wait(ctx, spec.MaxDuration)
	res := t.result()
	stop()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		return res, err
	}
	return res, nil
}

// percentile returns the p-th percentile (0..1) of ns values.
func percentile(ns []int64, p float64) time.Duration {
	if len(ns) == 0 {
		return 0
	}
	s := append([]int64(nil), ns...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	i := int(p * float64(len(s)-1))
	return time.Duration(s[i])
}

// MaybeWorker runs the worker and exits when this process is a bench
// worker; it returns false otherwise.
func maybeWorker(ctx context.Context) (bool, error) {
	spec := os.Getenv(workerEnv)
	if spec == "" {
		return false, nil
	}
	// IDEMQ_BENCH_CPUPROFILE=dir writes one CPU profile per worker there.
	if dir := os.Getenv("IDEMQ_BENCH_CPUPROFILE"); dir != "" {
		f, err := os.CreateTemp(dir, "worker-*.pprof")
		if err == nil {
			defer f.Close()
			if err := pprof.StartCPUProfile(f); err == nil {
				defer pprof.StopCPUProfile()
			}
		}
	}
	// IDEMQ_BENCH_MEMPROFILE=dir writes one allocation profile per worker
	// there, when the worker ends (go tool pprof -sample_index=alloc_space).
	if dir := os.Getenv("IDEMQ_BENCH_MEMPROFILE"); dir != "" {
		defer func() {
			if f, err := os.CreateTemp(dir, "worker-*.allocs.pprof"); err == nil {
				_ = pprof.Lookup("allocs").WriteTo(f, 0)
				_ = f.Close()
			}
		}()
	}
	return true, runWorker(ctx, spec, os.Stdout)
}
