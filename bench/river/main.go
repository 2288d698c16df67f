// Command river is a peer of the idemq benchmark: the same effect as idemq's
// handlers (one ledger row per message) done by River, a Postgres job queue,
// with the job's completion in the effect's transaction (JobCompleteTx).
//
// It runs in two invocations, so that the bench measures the drain alone:
//
//	river insert --postgres-url URL --schema S --count N   # fresh schema, River's migrations, N jobs (InsertMany)
//	river work   --postgres-url URL --schema S --count N   # 100 workers drain them, then one JSON line
//
// Each job runs one transaction: INSERT one ledger row, JobCompleteTx, COMMIT.
// work prints
//
//	{"completed":..,"first_to_last_ns":..,"elapsed_ns":..}
//
// where first_to_last_ns runs from the first Work call to the N-th commit.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

// benchArgs is the job: the message's key.
type benchArgs struct {
	Key string `json:"key"`
}

func (benchArgs) Kind() string { return "idemq_bench" }

type result struct {
	Completed   int64 `json:"completed"`
	FirstToLast int64 `json:"first_to_last_ns"`
	ElapsedNs   int64 `json:"elapsed_ns"`
}

func main() {
	if len(os.Args) < 2 || (os.Args[1] != "insert" && os.Args[1] != "work") {
		fmt.Fprintln(os.Stderr, "usage: river insert|work --postgres-url URL --schema S --count N [flags]")
		os.Exit(2)
	}
	fs := flag.NewFlagSet(os.Args[1], flag.ExitOnError)
	url := fs.String("postgres-url", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable", "Postgres URL")
	schema := fs.String("schema", "idemq_bench_river", "schema of River's tables and the ledger (insert drops and recreates it)")
	count := fs.Int("count", 0, "jobs")
	workers := fs.Int("workers", 100, "work: MaxWorkers of the queue")
	conns := fs.Int("conns", 0, "work: pool connections (0: workers/4 + 4)")
	cooldown := fs.Duration("fetch-cooldown", river.FetchCooldownDefault, "work: River's FetchCooldown")
	poll := fs.Duration("fetch-poll-interval", river.FetchPollIntervalDefault, "work: River's FetchPollInterval")
	maxDuration := fs.Duration("max-duration", 10*time.Minute, "work: give up (exit 1) if --count jobs are not done in this time")
	_ = fs.Parse(os.Args[2:])
	if *count <= 0 || *workers < 1 {
		fmt.Fprintln(os.Stderr, "river: --count and --workers must be positive")
		os.Exit(2)
	}
	ctx := context.Background()
	var err error
	if os.Args[1] == "insert" {
		err = insert(ctx, *url, *schema, *count)
	} else {
		var res result
		res, err = work(ctx, *url, *schema, *count, *workers, cmpOr(*conns, *workers/4+4), *cooldown, *poll, *maxDuration)
		if err == nil {
			out, _ := json.Marshal(res)
			fmt.Println(string(out))
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "river:", err)
		os.Exit(1)
	}
}

func cmpOr(a, b int) int {
	if a != 0 {
		return a
	}
	return b
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// insert makes a fresh schema with River's tables and a ledger, then N jobs.
func insert(ctx context.Context, url, schema string, count int) error {
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	s := pgx.Identifier{schema}.Sanitize()
	if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+s+" CASCADE; CREATE SCHEMA "+s); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE "+s+".ledger (key text NOT NULL)"); err != nil {
		return err
	}
	driver := riverpgxv5.New(pool)
	m, err := rivermigrate.New(driver, &rivermigrate.Config{Schema: schema, Logger: quiet()})
	if err != nil {
		return err
	}
	if _, err := m.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	// An insert-only client: no queues, no workers.
	client, err := river.NewClient(driver, &river.Config{Schema: schema, Logger: quiet()})
	if err != nil {
		return err
	}
	const chunk = 1000
	params := make([]river.InsertManyParams, 0, chunk)
	for i := 0; i < count; i += chunk {
		params = params[:0]
		for j := i; j < min(count, i+chunk); j++ {
			params = append(params, river.InsertManyParams{Args: benchArgs{Key: "r-" + strconv.Itoa(j)}})
		}
		if _, err := client.InsertMany(ctx, params); err != nil {
			return fmt.Errorf("insert: %w", err)
		}
	}
	_, err = pool.Exec(ctx, "ANALYZE "+s+".river_job")
	return err
}

// benchWorker writes the ledger row and completes the job in one transaction.
type benchWorker struct {
	river.WorkerDefaults[benchArgs]
	pool   *pgxpool.Pool
	ledger string
	count  int64
	done   atomic.Int64
	first  atomic.Int64
	last   atomic.Int64
	finish func()
}

func (w *benchWorker) Work(ctx context.Context, job *river.Job[benchArgs]) error {
	w.first.CompareAndSwap(0, time.Now().UnixNano())
	tx, err := w.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, "INSERT INTO "+w.ledger+" (key) VALUES ($1)", job.Args.Key); err != nil {
		return err
	}
	if _, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	if w.done.Add(1) == w.count {
		w.last.Store(time.Now().UnixNano())
		w.finish()
	}
	return nil
}

func work(ctx context.Context, url, schema string, count, workers, conns int, cooldown, poll, maxDuration time.Duration) (result, error) {
	start := time.Now()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return result{}, err
	}
	cfg.MaxConns = int32(conns)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return result{}, err
	}
	defer pool.Close()
	done := make(chan struct{})
	var once sync.Once
	w := &benchWorker{pool: pool, ledger: pgx.Identifier{schema, "ledger"}.Sanitize(), count: int64(count),
		finish: func() { once.Do(func() { close(done) }) }}
	ws := river.NewWorkers()
	river.AddWorker(ws, w)
	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
		Schema:            schema,
		Logger:            quiet(),
		Queues:            map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: workers}},
		Workers:           ws,
		FetchCooldown:     cooldown,
		FetchPollInterval: max(poll, cooldown),
	})
	if err != nil {
		return result{}, err
	}
	if err := client.Start(ctx); err != nil {
		return result{}, err
	}
	var runErr error
	select {
	case <-done:
	case <-time.After(maxDuration):
		runErr = fmt.Errorf("timeout: %d of %d jobs after %s", w.done.Load(), count, maxDuration)
	}
	end := time.Now()
	stopCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := client.Stop(stopCtx); err != nil && !errors.Is(err, context.Canceled) {
		fmt.Fprintln(os.Stderr, "river: stop:", err)
	}
	if runErr != nil {
		return result{}, runErr
	}
	return result{Completed: w.done.Load(), FirstToLast: w.last.Load() - w.first.Load(), ElapsedNs: end.Sub(start).Nanoseconds()}, nil
}
