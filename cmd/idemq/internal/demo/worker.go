package demo

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/redact"
)

// IsWorker reports whether this process was started by Run as a worker: Run
// then consumes until SIGTERM instead of running the scenario. A CLI can use
// it to skip output meant for the user.
func IsWorker() bool {
	_, ok := os.LookupEnv(WorkerEnv)
	return ok
}

// workerConfig is what the parent hands a worker, as JSON in WorkerEnv.
type workerConfig struct {
	Index       int    `json:"index"`
	PostgresURL string `json:"postgres_url"`
	AMQPURL     string `json:"amqp_url"`
	Schema      string `json:"schema"`
	Queue       string `json:"queue"`
	Concurrency int    `json:"concurrency"`
	// WatchStdin stops the worker when its stdin reaches EOF: the parent
	// holds the pipe's other end, so a parent that dies stops its workers.
	WatchStdin bool `json:"watch_stdin"`
}

// runWorker is a worker's life: consume with the payment handler until
// SIGTERM, SIGINT, the end of ctx or EOF on stdin; then drain and return.
func runWorker(ctx context.Context, raw string) error {
	var wc workerConfig
	if err := json.Unmarshal([]byte(raw), &wc); err != nil {
		return fmt.Errorf("demo worker: read %s: %w", WorkerEnv, err)
	}
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, os.Interrupt)
	defer stop()
	if wc.WatchStdin {
		go func() {
			_, _ = io.Copy(io.Discard, os.Stdin)
			stop()
		}()
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})).
		With("worker", wc.Index, "pid", os.Getpid())

	pool, err := newPool(ctx, wc.PostgresURL, int32(wc.Concurrency+4), fmt.Sprintf("idemq-demo-worker-%d", wc.Index), false)
	if err != nil {
		return fmt.Errorf("demo worker: %w", err)
	}
	defer pool.Close()
	// Events are best effort: written apart from the handler's transaction,
	// batched, without waiting for the WAL flush.
	evPool, err := newPool(ctx, wc.PostgresURL, 2, fmt.Sprintf("idemq-demo-events-%d", wc.Index), true)
	if err != nil {
		return fmt.Errorf("demo worker: %w", err)
	}
	defer evPool.Close()
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: wc.Schema, Lease: lease})
	if err != nil {
		return fmt.Errorf("demo worker: %w", err)
	}
	rec := newRecorder(evPool, wc.Schema, wc.Index, log)
	defer rec.close()

	h := &handler{schema: wc.Schema, worker: wc.Index}
	cfg := consumerConfig(wc.AMQPURL, wc.Queue)
	cfg.Concurrency = wc.Concurrency
	cfg.Logger = log
	cfg.OnOutcome = rec.add
	cfg.ConnectionName = fmt.Sprintf("%s-worker-%d", cfg.ConnectionName, wc.Index)
	c, err := consumer.New(store, h.handle, cfg)
	if err != nil {
		return fmt.Errorf("demo worker: %w", err)
	}
	log.Info("worker started")
	if err := c.Run(ctx); err != nil {
		return fmt.Errorf("demo worker: %w", err)
	}
	log.Info("worker stopped")
	return nil
}

// newPool opens a pool; relaxed turns synchronous_commit off (for the
// best-effort event log only).
func newPool(ctx context.Context, url string, maxConns int32, name string, relaxed bool) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("parse Postgres URL %s: %s", redact.URL(url), redact.Error(err))
	}
	cfg.MaxConns = maxConns
	cfg.ConnConfig.RuntimeParams["application_name"] = name
	if relaxed {
		cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "off"
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to Postgres %s: %s", redact.URL(url), redact.Error(err))
	}
	return pool, nil
}

// handler charges cards: the payment handler of the scenario.
type handler struct {
	schema string
	worker int
}

func (h *handler) handle(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
	p, err := parsePayment(d.Body)
	if err != nil {
		return consumer.Response{}, consumer.Permanent(err)
	}
	// The card network is asked first; these are infrastructure failures.
	if p.Network == downNetwork {
		return consumer.Response{}, fmt.Errorf("card network %s unreachable (%w outage)", p.Network, errInjected)
	}
	if d.Attempt == 1 && flaky(d.Key) {
		return consumer.Response{}, fmt.Errorf("card network %s timed out (%w, first attempt)", p.Network, errInjected)
	}
	if p.Amount > balanceLimit {
		body, _ := json.Marshal(map[string]any{"status": "declined", "reason": "insufficient funds"})
		return consumer.Response{}, consumer.Reject(402, "insufficient funds", body)
	}
	var id int64
	err = tx.QueryRow(ctx, `INSERT INTO `+pgx.Identifier{h.schema, "charges"}.Sanitize()+`
    (key, account, amount, currency, network, worker, attempt) VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id`,
		d.Key, p.Account, p.Amount, p.Currency, p.Network, h.worker, d.Attempt).Scan(&id)
	if err != nil {
		return consumer.Response{}, fmt.Errorf("insert charge: %w", err)
	}
	body, _ := json.Marshal(map[string]any{"status": "charged", "charge_id": id})
	return consumer.Response{Code: 201, Body: body}, nil
}

// recorder writes the consumer's events into the events table, batched, so
// that the parent can follow and report across processes. Best effort: a
// full buffer drops events, and a killed worker loses its last batch.
type recorder struct {
	pool   *pgxpool.Pool
	table  pgx.Identifier
	worker int
	log    *slog.Logger
	ch     chan []any
	done   chan struct{}
}

var eventColumns = []string{"worker", "outcome", "reason", "key_hash", "attempt", "trace_id", "original_trace_id", "error", "duration_us"}

func newRecorder(pool *pgxpool.Pool, schema string, worker int, log *slog.Logger) *recorder {
	r := &recorder{
		pool: pool, table: pgx.Identifier{schema, "events"}, worker: worker, log: log,
		ch: make(chan []any, 8192), done: make(chan struct{}),
	}
	go r.loop()
	return r
}

func (r *recorder) add(ev consumer.Event) {
	var errText string
	if ev.Err != nil {
		errText = truncate(redact.Error(ev.Err), 300)
	}
	row := []any{int32(r.worker), string(ev.Outcome), ev.Reason, ev.KeyHash, int32(ev.Attempt),
		ev.TraceID, ev.OriginalTraceID, errText, ev.Duration.Microseconds()}
	select {
	case r.ch <- row:
	default:
		r.log.Warn("event buffer full; event dropped")
	}
}

func (r *recorder) loop() {
	defer close(r.done)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	var batch [][]any
	flush := func() {
		if len(batch) == 0 {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := r.pool.CopyFrom(ctx, r.table, eventColumns, pgx.CopyFromRows(batch)); err != nil {
			r.log.Warn("record events", "n", len(batch), "err", redact.Error(err))
		}
		batch = batch[:0]
	}
	for {
		select {
		case row, ok := <-r.ch:
			if !ok {
				flush()
				return
			}
			batch = append(batch, row)
			if len(batch) >= 500 {
				flush()
			}
		case <-tick.C:
			flush()
		}
	}
}

// close flushes what is buffered. Call it after the consumer stopped.
func (r *recorder) close() {
	close(r.ch)
	<-r.done
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return strings.ToValidUTF8(s[:n], "")
}
