// Package scale measures retention at size: it loads a key table (and an
// outbox) holding one simulated day of keys, then runs a worker at a steady
// rate while the library's GC retires the oldest keys at the same rate, cycle
// after cycle, and prints what each cycle cost: the worker's throughput and
// p99 with and without GC running, the longest lock wait a worker statement
// saw, GC's own rate, and the tables' sizes, dead tuples and autovacuum runs.
//
// # The simulated day
//
// The loaded keys are spread evenly over the 24 hours before the load, as a
// day of traffic at Keys per day leaves them. The run then compresses time:
// each cycle the worker adds Rate × Cycle keys, and GC moves the retention
// horizon forward by the stretch of the simulated day that holds as many
// keys, so that it retires exactly what the worker added. The table keeps
// its size in rows; whether it keeps its size on disk is what the run shows.
// A run that adds more keys than the day held goes on past the day's end
// with a fixed retention (the span in which the worker added a day's worth),
// turning the table over, to show where its indexes settle.
//
// The worker runs the protocol's own statements (dedup.Store.Reserve, then
// outbox.Enqueue and dedup.Store.Complete in one transaction); a share of its
// operations are duplicates of keys already stored, anywhere in the day. The
// broker is left out: a marker goroutine marks the outbox rows published with
// the relay's statement, so that GC has published rows to retire.
package scale

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/outbox"
)

// Defaults of Options.
const (
	DefaultSchema      = "idemq_scale"
	DefaultKeys        = 10_000_000
	DefaultCycles      = 6
	DefaultCycle       = 60 * time.Second
	DefaultRate        = 400
	DefaultConcurrency = 8
	DefaultDuplicates  = 0.1
)

// Options configures a run.
type Options struct {
	// PostgresURL is the database to load; the run owns Schema in it.
	PostgresURL string
	// Schema is dropped and created again with the project's migrations
	// (default DefaultSchema). It must contain "scale".
	Schema string
	// Keys is the number of keys of one day, loaded before the cycles; the
	// outbox gets as many published rows.
	Keys int
	// Outbox is the number of outbox rows loaded (default Keys).
	Outbox int
	// Cycles and Cycle are how many cycles run and how long each lasts.
	Cycles int
	Cycle  time.Duration
	// Rate is the worker's operations per second; Concurrency the number of
	// connections it runs them on.
	Rate, Concurrency int
	// Duplicates is the share of operations that repeat a stored key.
	Duplicates float64
	// GCBatch is the GC's batch size (default dedup.DefaultGCBatchSize).
	GCBatch int
	// GCPause is the pause GC takes after each batch (see dedup.GCOptions).
	GCPause time.Duration
	// GCVacuum makes GC vacuum each table after deleting (dedup.GCOptions.Vacuum).
	GCVacuum bool
	// SchemaVersion migrates the schema only that far (0: all the way), to
	// measure an earlier design.
	SchemaVersion int
	// Keep leaves the schema in place after the run, for inspection or for
	// a later run with Reuse.
	Keep bool
	// Reuse runs the cycles on the day an earlier run with Keep left in the
	// schema, when it holds as many keys and outbox rows, instead of loading
	// one again; it goes on retiring from where that run stopped.
	Reuse bool
	// Log receives progress lines (default io.Discard).
	Log io.Writer
}

func (o Options) withDefaults() Options {
	o.Schema = cmp.Or(o.Schema, DefaultSchema)
	o.Keys = cmp.Or(o.Keys, DefaultKeys)
	o.Outbox = cmp.Or(o.Outbox, o.Keys)
	o.Cycles = cmp.Or(o.Cycles, DefaultCycles)
	o.Cycle = cmp.Or(o.Cycle, DefaultCycle)
	o.Rate = cmp.Or(o.Rate, DefaultRate)
	o.Concurrency = cmp.Or(o.Concurrency, DefaultConcurrency)
	o.GCBatch = cmp.Or(o.GCBatch, dedup.DefaultGCBatchSize)
	if o.Duplicates == 0 {
		o.Duplicates = DefaultDuplicates
	}
	if o.Duplicates < 0 {
		o.Duplicates = 0
	}
	if o.Log == nil {
		o.Log = io.Discard
	}
	return o
}

func (o Options) validate() error {
	if err := schema.Validate(o.Schema); err != nil {
		return err
	}
	if !strings.Contains(o.Schema, "scale") {
		return fmt.Errorf("schema %q: the run drops it, so its name must contain \"scale\"", o.Schema)
	}
	if o.Keys < 1000 || o.Outbox < 0 || o.Cycles < 1 || o.Cycle < 5*time.Second || o.Rate < 1 || o.Concurrency < 1 || o.GCBatch < 1 {
		return errors.New("keys ≥ 1000, cycles ≥ 1, cycle ≥ 5s, rate, concurrency and batch ≥ 1")
	}
	if o.Reuse && !o.Keep {
		return errors.New("reuse goes with keep: a reused day is kept for the next run")
	}
	return nil
}

// Result is what a run measured.
type Result struct {
	Load   LoadResult
	Start  Sizes
	Cycles []Cycle
	// EndKeys and EndOutbox are the rows of both tables after the last
	// cycle, counted.
	EndKeys, EndOutbox int64
}

// Run loads the day, runs the cycles and writes the per-cycle tables to out.
func Run(ctx context.Context, o Options, out io.Writer) (Result, error) {
	o = o.withDefaults()
	var res Result
	if err := o.validate(); err != nil {
		return res, fmt.Errorf("scale: %w", err)
	}
	pools, err := openPools(ctx, o)
	if err != nil {
		return res, err
	}
	defer pools.close()
	var reused bool
	if o.Reuse {
		if res.Load, reused, err = loadedDay(ctx, pools.admin, o); err != nil {
			return res, err
		}
	}
	if !reused {
		if err := reset(ctx, pools.admin, o.Schema, o.SchemaVersion); err != nil {
			return res, err
		}
	}
	if !o.Keep {
		defer func() {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
			defer cancel()
			_, _ = pools.admin.Exec(dctx, "DROP SCHEMA IF EXISTS "+o.Schema+" CASCADE")
		}()
	}
	if reused {
		fmt.Fprintf(o.Log, "going on with the day in schema %s: %d keys, %d retired so far\n", o.Schema, res.Load.Keys, res.Load.Retired)
	} else {
		fmt.Fprintf(o.Log, "loading %d keys and %d published outbox messages into schema %s (COPY)\n", o.Keys, o.Outbox, o.Schema)
		if res.Load, err = load(ctx, pools.admin, o); err != nil {
			return res, err
		}
		if err := saveDay(ctx, pools.admin, o.Schema, res.Load); err != nil {
			return res, err
		}
		fmt.Fprintf(o.Log, "loaded in %s (keys %s, outbox %s)\n", res.Load.Took.Round(time.Second), res.Load.KeysTook.Round(time.Second), res.Load.OutboxTook.Round(time.Second))
	}
	if res.Start, err = sizes(ctx, pools.admin, o.Schema); err != nil {
		return res, err
	}
	fmt.Fprintf(o.Log, "start: %s\n", res.Start)
	res.Cycles, err = cycles(ctx, pools, o, res.Load)
	if err == nil {
		err = pools.admin.QueryRow(ctx, "SELECT (SELECT count(*) FROM "+o.Schema+".keys), (SELECT count(*) FROM "+o.Schema+".outbox_published)").Scan(&res.EndKeys, &res.EndOutbox)
	}
	printHeader(out, o, res)
	printCycles(out, res.Cycles)
	printSummary(out, res)
	if err != nil {
		return res, err
	}
	return res, nil
}

// pools are the run's connection pools, one per role, each with its own
// application_name so that the lock sampler tells the worker's statements apart.
type pools struct {
	admin, worker, gc *pgxpool.Pool
}

const (
	appWorker = "idemq-scale-worker"
	appGC     = "idemq-scale-gc"
)

func openPools(ctx context.Context, o Options) (*pools, error) {
	open := func(app string, conns int32) (*pgxpool.Pool, error) {
		cfg, err := pgxpool.ParseConfig(o.PostgresURL)
		if err != nil {
			return nil, fmt.Errorf("scale: postgres url: %w", err)
		}
		cfg.MaxConns = conns
		cfg.ConnConfig.RuntimeParams["application_name"] = app
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			return nil, fmt.Errorf("scale: connect: %w", err)
		}
		if err := pool.Ping(ctx); err != nil {
			pool.Close()
			return nil, fmt.Errorf("scale: connect: %w", err)
		}
		return pool, nil
	}
	var p pools
	var err error
	if p.admin, err = open("idemq-scale", 4); err != nil {
		return nil, err
	}
	if p.worker, err = open(appWorker, int32(o.Concurrency)+2); err != nil {
		p.close()
		return nil, err
	}
	if p.gc, err = open(appGC, 2); err != nil {
		p.close()
		return nil, err
	}
	return &p, nil
}

func (p *pools) close() {
	for _, pool := range []*pgxpool.Pool{p.admin, p.worker, p.gc} {
		if pool != nil {
			pool.Close()
		}
	}
}

// reset drops the run's schema and creates it again with the migrations.
func reset(ctx context.Context, pool *pgxpool.Pool, name string, version int) error {
	if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+name+" CASCADE"); err != nil {
		return fmt.Errorf("scale: drop schema: %w", err)
	}
	migrate := func() error { return schema.Migrate(ctx, pool, name) }
	if version > 0 {
		migrate = func() error { return schema.MigrateTo(ctx, pool, name, version) }
	}
	if err := migrate(); err != nil {
		return fmt.Errorf("scale: %w", err)
	}
	return nil
}

// newStore and newOutbox are the library's objects over a run's pool.
func newStore(pool *pgxpool.Pool, o Options) (*dedup.Store, error) {
	return dedup.NewStore(pool, &dedup.Config{Schema: o.Schema, GCBatchSize: o.GCBatch})
}

func newOutbox(pool *pgxpool.Pool, o Options) (*outbox.Outbox, error) {
	return outbox.New(pool, &outbox.Config{Schema: o.Schema})
}
