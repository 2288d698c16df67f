package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/outbox"
)

// workerEnv holds a worker's configuration (JSON). When it is set, the test
// binary is a worker process: TestMain runs runWorker instead of the tests.
const workerEnv = "IDEMQ_CHAOS_WORKER"

// workerConfig is what the soak hands a worker process.
type workerConfig struct {
	Index       int    `json:"index"`
	Incarnation int    `json:"incarnation"`
	Name        string `json:"name"` // the consumer's scope
	PostgresURL string `json:"postgres_url"`
	// ListenURL, when set, is where the relay's LISTEN connection goes
	// (outbox.RelayConfig.ListenConfig): Postgres itself, when
	// PostgresURL goes through a transaction pooler.
	ListenURL   string `json:"listen_url,omitempty"`
	AMQPURL     string `json:"amqp_url"`
	StatsURL    string `json:"stats_url"`
	Schema      string `json:"schema"`
	Queue       string `json:"queue"`
	OutExchange string `json:"out_exchange"`
	// AppName is the application_name of the worker's Postgres sessions
	// and the name of its broker connections.
	AppName     string `json:"app_name"`
	Concurrency int    `json:"concurrency"`
	GroupSize   int    `json:"group_size"`
	Optimistic  bool   `json:"optimistic"`
	// Batch runs the handler as a BatchHandler (consumer.NewBatch).
	Batch       bool `json:"batch"`
	LeaseMS     int  `json:"lease_ms"`
	MaxAttempts int  `json:"max_attempts"`
	// Partitions, when positive, consumes the partitions of a partitioned
	// queue with ordering on (an ordered soak).
	Partitions int `json:"partitions"`
}

// consumerConfig is the configuration every worker of the soak shares.
func (wc workerConfig) consumerConfig() consumer.Config {
	cfg := consumer.Config{
		URL:             wc.AMQPURL,
		Queue:           wc.Queue,
		Name:            wc.Name,
		Concurrency:     wc.Concurrency,
		Group:           consumer.Group{Size: wc.GroupSize, Optimistic: wc.Optimistic},
		Lease:           time.Duration(wc.LeaseMS) * time.Millisecond,
		HandlerTimeout:  20 * time.Second,
		ShutdownTimeout: 15 * time.Second,
		PublishTimeout:  10 * time.Second,
		MaxAttempts:     wc.MaxAttempts,
		RetryInitial:    500 * time.Millisecond,
		RetryMultiplier: 2,
		RetryMax:        8 * time.Second,
		ConnectionName:  wc.AppName,
	}
	if wc.Partitions > 0 {
		cfg.Partitions, cfg.Ordering = wc.Partitions, &consumer.Ordering{}
	}
	return cfg
}

// runWorker is a worker process's life: a consumer and an outbox relay
// until SIGTERM (or EOF on stdin: the soak went away), then a drain.
func runWorker(raw string) int {
	var wc workerConfig
	if err := json.Unmarshal([]byte(raw), &wc); err != nil {
		fmt.Fprintf(os.Stderr, "chaos worker: %s: %v\n", workerEnv, err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		stop()
	}()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})).
		With("worker", wc.Index, "incarnation", wc.Incarnation, "pid", os.Getpid())
	if err := work(ctx, wc, log); err != nil {
		log.Error("worker failed", "err", redact.Error(err))
		return 3
	}
	log.Info("worker stopped")
	return 0
}

func work(ctx context.Context, wc workerConfig, log *slog.Logger) error {
	pool, err := workerPool(wc.PostgresURL, wc.AppName, int32(wc.Concurrency+6))
	if err != nil {
		return err
	}
	defer pool.Close()
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: wc.Schema, Lease: time.Duration(wc.LeaseMS) * time.Millisecond})
	if err != nil {
		return err
	}
	st := newWorkerStats(wc, log)
	defer st.close()

	cfg := wc.consumerConfig()
	cfg.Logger = log
	cfg.OnOutcome = st.add
	h := &soakHandler{schema: wc.Schema, out: wc.OutExchange, worker: wc.Index}
	var cons *consumer.Consumer
	if wc.Batch {
		cons, err = consumer.NewBatch(store, batchOf(h.handle), &cfg)
	} else {
		cons, err = consumer.New(store, h.handle, &cfg)
	}
	if err != nil {
		return err
	}
	ob, err := outbox.New(pool, &outbox.Config{Schema: wc.Schema})
	if err != nil {
		return err
	}
	var listen *pgx.ConnConfig
	if wc.ListenURL != "" {
		if listen, err = pgx.ParseConfig(wc.ListenURL); err != nil {
			return fmt.Errorf("parse the LISTEN URL: %s", redact.Error(err))
		}
		listen.ConnectTimeout = 5 * time.Second
	}
	relay, err := outbox.NewRelay(ob, wc.AMQPURL, &outbox.RelayConfig{
		ListenConfig:   listen,
		ConnectionName: wc.AppName + "-relay",
		Logger:         log,
		PollInterval:   500 * time.Millisecond,
		RetryInitial:   200 * time.Millisecond,
		RetryMax:       5 * time.Second,
		ReconnectMax:   5 * time.Second,
	})
	if err != nil {
		return err
	}
	log.Info("worker started", "group_size", wc.GroupSize, "optimistic", wc.Optimistic, "batch", wc.Batch)
	var wg sync.WaitGroup
	errs := make([]error, 2)
	wg.Go(func() { errs[0] = cons.Run(ctx) })
	wg.Go(func() { errs[1] = relay.Run(ctx) })
	wg.Wait()
	return errors.Join(errs...)
}

// workerPool opens a pool whose sessions carry appName, so that the soak's
// pg_terminate_backend finds them and nothing else. Connections are made
// lazily: Postgres may well be down when a worker starts.
func workerPool(url, appName string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("parse Postgres URL: %s", redact.Error(err))
	}
	cfg.MaxConns = maxConns
	cfg.ConnConfig.ConnectTimeout = 5 * time.Second
	cfg.ConnConfig.RuntimeParams["application_name"] = appName
	return pgxpool.NewWithConfig(context.Background(), cfg)
}

// payload is the body of a soak message. Poison bodies are not JSON, or
// have kind "poison".
type payload struct {
	Op     int    `json:"op"`
	Tenant string `json:"tenant"`
	Key    string `json:"key"`
	Kind   string `json:"kind"`
	// FailFirst is how many first attempts fail with an infrastructure error.
	FailFirst int    `json:"fail_first,omitempty"`
	Amount    int64  `json:"amount"`
	Pad       string `json:"pad,omitempty"`
	// OrderingKey and Sequence are an ordered op's (ordered_test.go).
	OrderingKey string `json:"ordering_key,omitempty"`
	Sequence    int    `json:"sequence,omitempty"`
}

// soakHandler writes one ledger row per processed message and forwards the
// message through the outbox, in the handler's transaction.
type soakHandler struct {
	schema, out string
	worker      int
}

var errInjected = errors.New("injected infrastructure failure")

func (h *soakHandler) handle(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
	var p payload
	if err := json.Unmarshal(d.Body, &p); err != nil {
		return consumer.Response{}, consumer.Permanent(fmt.Errorf("decode body: %w", err))
	}
	if p.Kind == kindPoison {
		return consumer.Response{}, consumer.Permanent(fmt.Errorf("op %d is poison", p.Op))
	}
	if p.Kind == kindAtFrameMax {
		// Always an infrastructure failure: its retry copy cannot fit, so
		// it must be dead-lettered headers_too_large.
		return consumer.Response{}, fmt.Errorf("op %d, attempt %d (at frame_max): %w", p.Op, d.Attempt, errInjected)
	}
	if d.Attempt <= p.FailFirst {
		return consumer.Response{}, fmt.Errorf("op %d, attempt %d: %w", p.Op, d.Attempt, errInjected)
	}
	if p.Kind == kindReject {
		return consumer.Response{}, consumer.Reject(402, "insufficient funds", []byte(`{"status":"declined"}`))
	}
	// A near_frame_max op comes back from its retry tier trimmed: the
	// tracestate it was published with is gone.
	_, hasTraceState := d.Headers["tracestate"]
	trimmed := p.Kind == kindNearFrameMax && !hasTraceState
	_, err := tx.Exec(ctx, `INSERT INTO `+pgx.Identifier{h.schema, "ledger"}.Sanitize()+
		` (tenant, key, op, worker, attempt, trimmed) VALUES ($1, $2, $3, $4, $5, $6)`,
		d.Tenant, d.Key, p.Op, h.worker, d.Attempt, trimmed)
	if err != nil {
		return consumer.Response{}, fmt.Errorf("insert ledger row: %w", err)
	}
	// No MessageID: the outbox derives it from the claim (consumer, tenant,
	// key), the same on every retry; the soak checks it on the output queue.
	// An ordered op is forwarded with its entity as the ordering key: the
	// relays publish each entity's rows in commit order, numbered again.
	msg := outbox.Message{
		Exchange:    h.out,
		RoutingKey:  routeForwarded,
		Body:        d.Body,
		ContentType: "application/json",
		Headers:     amqp.Table{"x-chaos-op": int64(p.Op), "x-tenant-id": d.Tenant},
		OrderingKey: p.OrderingKey,
	}
	// Twins: two rows, one explicit message_id, two routes, one of them
	// unroutable for twin_void.
	twin := twinRoute(p.Kind)
	if twin != "" {
		msg.MessageID = twinMessageID(p.Op)
	}
	if err := outbox.Enqueue(ctx, tx, msg); err != nil {
		return consumer.Response{}, fmt.Errorf("forward: %w", err)
	}
	if twin != "" {
		msg.RoutingKey = twin
		if err := outbox.Enqueue(ctx, tx, msg); err != nil {
			return consumer.Response{}, fmt.Errorf("forward twin: %w", err)
		}
	}
	return consumer.Response{Code: 201}, nil
}

// workerStats counts the consumer's outcomes and writes the running totals
// to the stats table four times a second, on a direct connection (best
// effort: a killed worker loses its last counts).
type workerStats struct {
	mu     sync.Mutex
	counts map[string]int64
	done   chan struct{}
	closed chan struct{}
}

func newWorkerStats(wc workerConfig, log *slog.Logger) *workerStats {
	st := &workerStats{counts: map[string]int64{}, done: make(chan struct{}), closed: make(chan struct{})}
	incarnation := fmt.Sprintf("w%d.%d", wc.Index, wc.Incarnation)
	go func() {
		defer close(st.closed)
		var conn *pgx.Conn
		defer func() {
			if conn != nil {
				_ = conn.Close(context.Background())
			}
		}()
		flush := func() {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if conn == nil || conn.IsClosed() {
				c, err := pgx.Connect(ctx, wc.StatsURL)
				if err != nil {
					return
				}
				conn = c
			}
			st.mu.Lock()
			outcomes, counts := make([]string, 0, len(st.counts)), make([]int64, 0, len(st.counts))
			for o, n := range st.counts {
				outcomes, counts = append(outcomes, o), append(counts, n)
			}
			st.mu.Unlock()
			_, err := conn.Exec(ctx, `INSERT INTO `+pgx.Identifier{wc.Schema, "stats"}.Sanitize()+` (incarnation, outcome, n)
SELECT $1, o, n FROM unnest($2::text[], $3::bigint[]) AS u(o, n)
ON CONFLICT (incarnation, outcome) DO UPDATE SET n = excluded.n`, incarnation, outcomes, counts)
			if err != nil {
				_ = conn.Close(context.Background())
				conn = nil
				log.Debug("stats not written", "err", redact.Error(err))
			}
		}
		t := time.NewTicker(250 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-st.done:
				flush()
				return
			case <-t.C:
				flush()
			}
		}
	}()
	return st
}

func (st *workerStats) add(ev consumer.Event) {
	name := string(ev.Outcome)
	if ev.Reason != "" {
		name += ":" + ev.Reason
	}
	st.mu.Lock()
	st.counts[name]++
	st.mu.Unlock()
}

func (st *workerStats) close() {
	close(st.done)
	<-st.closed
}

// ---------------------------------------------------------------- processes

// workerProc is one worker process as the soak sees it.
type workerProc struct {
	cfg     workerConfig
	cmd     *exec.Cmd
	stdin   io.WriteCloser
	logPath string
	exited  chan struct{}
	err     error
	// expected is set when the soak itself ends the process.
	expected atomic.Bool
}

func startWorker(wc workerConfig, logDir string) (*workerProc, error) {
	raw, err := json.Marshal(wc)
	if err != nil {
		return nil, err
	}
	logPath := filepath.Join(logDir, fmt.Sprintf("worker-%d.%d.log", wc.Index, wc.Incarnation))
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	defer logFile.Close() // the child holds its own descriptor
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), workerEnv+"="+string(raw))
	cmd.Stdout, cmd.Stderr = logFile, logFile
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start worker %d: %w", wc.Index, err)
	}
	w := &workerProc{cfg: wc, cmd: cmd, stdin: stdin, logPath: logPath, exited: make(chan struct{})}
	go func() {
		w.err = cmd.Wait()
		close(w.exited)
	}()
	return w, nil
}

func (w *workerProc) done() bool {
	select {
	case <-w.exited:
		return true
	default:
		return false
	}
}

// kill ends the worker with SIGKILL, as a crash would, and waits for it.
func (w *workerProc) kill() {
	w.expected.Store(true)
	_ = w.cmd.Process.Kill()
	<-w.exited
	_ = w.stdin.Close()
}

// freeze stops the process (SIGSTOP) until thaw: it publishes nothing
// meanwhile. It reports whether the process was stopped.
func (w *workerProc) freeze() bool {
	return !w.done() && w.cmd.Process.Signal(syscall.SIGSTOP) == nil
}

func (w *workerProc) thaw() { _ = w.cmd.Process.Signal(syscall.SIGCONT) }

// stop asks the worker to drain and exit, and kills it after grace. It
// reports whether it stopped cleanly by itself.
func (w *workerProc) stop(grace time.Duration) bool {
	w.expected.Store(true)
	_ = w.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-w.exited:
		_ = w.stdin.Close()
		return w.err == nil
	case <-time.After(grace):
		w.kill()
		return false
	}
}

// batchOf runs a per-message handler over a batch in the batch's
// transaction: any failure fails the batch, which the runtime then runs
// one delivery at a time.
func batchOf(h consumer.Handler) consumer.BatchHandler {
	return func(ctx context.Context, tx pgx.Tx, ds []*consumer.Delivery) ([]consumer.Response, error) {
		out := make([]consumer.Response, len(ds))
		for i, d := range ds {
			r, err := h(ctx, tx, d)
			if err != nil {
				return nil, err
			}
			out[i] = r
		}
		return out, nil
	}
}
