// Package bench measures idemq against a bare RabbitMQ consumer in one run:
// the same queue kind, message shape and prefetch, each consumer in a
// process of its own so that its memory and CPU are its own. Beside them it
// runs the reference consumers of shared/benchref (the transactional floor
// and a minimal hand-written dedup consumer), the peers of bench/ (Watermill,
// River), and the publishing side: the outbox relay against a bare publisher
// with confirms, and the forwarding stage against a bare consume-publish pipe.
package bench

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/amqpdial"
	"github.com/idemq/idemq/internal/redact"
)

// Options configure a run. Zero fields take the defaults.
type Options struct {
	PostgresURL, AMQPURL string
	// Messages preloaded per throughput scenario. Default 20,000.
	Messages int
	// BodySize in bytes. Default 200.
	BodySize int
	// Concurrency (handlers) and Prefetch of every consumer, the bare one
	// included. Defaults 8 and 256.
	Concurrency, Prefetch int
	// MaxDuration bounds one throughput scenario. Default 15s.
	MaxDuration time.Duration
	// Paced messages per scenario for publish-to-ack latency, at PacedRate/s.
	// Defaults 300 at 200/s.
	Paced, PacedRate int
	// Sweep runs group commit at several group sizes for the plot.
	Sweep bool
	// PlotPath is where the SVG plot is written ("" = none).
	PlotPath string
	// BenchrefDir is the module of the reference consumers (shared/benchref).
	// A relative path is looked up from the working directory, then from
	// the project's root. "" or a missing module: the reference rows say
	// so instead of running.
	BenchrefDir string
	// WatermillDir and RiverDir are the peers' modules (bench/watermill,
	// bench/river), looked up like BenchrefDir; "" leaves their rows out.
	WatermillDir, RiverDir string
	// RiverWorkers is River's MaxWorkers. Default 100.
	RiverWorkers int
	// NoPublish leaves out the publishing side (relay, forward).
	NoPublish bool
	// PgBouncerURL, when set, is the bench's database through PgBouncer in
	// transaction mode (with default_query_exec_mode=cache_describe or
	// exec): the default mode and the batch handler run through it too, in
	// rows of their own.
	PgBouncerURL string
	// Only, when set, is a regular expression: only the rows whose name it
	// matches run, with the bare rows of their table (the ratios' base); a
	// table none of whose other rows matches is left out.
	Only string
	// HTTPDuration is how long wrk loads each HTTP row (and the paced
	// open-loop phase lasts). Default 10s.
	HTTPDuration time.Duration
	// NoHTTP leaves out the HTTP front door.
	NoHTTP bool
}

func (o Options) withDefaults() Options {
	if o.Messages == 0 {
		o.Messages = 20000
	}
	if o.BodySize == 0 {
		o.BodySize = 200
	}
	if o.Concurrency == 0 {
		o.Concurrency = 8
	}
	if o.Prefetch == 0 {
		o.Prefetch = 256
	}
	if o.MaxDuration == 0 {
		o.MaxDuration = 15 * time.Second
	}
	if o.Paced == 0 {
		o.Paced = 300
	}
	if o.PacedRate == 0 {
		o.PacedRate = 200
	}
	if o.RiverWorkers == 0 {
		o.RiverWorkers = 100
	}
	if o.HTTPDuration == 0 {
		o.HTTPDuration = 10 * time.Second
	}
	return o
}

// Section names the three tables.
const (
	SectionConsume = "consume"
	SectionPublish = "publish"
	SectionHTTP    = "http"
)

// Result is one scenario's figures.
type Result struct {
	Section  string
	Scenario string
	Settled  int
	Rate     float64 // messages settled per second
	// Ratio is Rate over the bare rows of the same table (consume), or of
	// the same group (publish: one queue kind, or the forwarding pair).
	Ratio float64
	// RefRatio (consume) is Rate over the reference of the targets: the
	// mean of the runs of benchref tx2, first and last (0: not run).
	RefRatio   float64
	P50, P99   time.Duration
	PeakRSSKiB int64
	// CPUPerMsg is the worker process's user+sys time per message;
	// PGPerMsg and MQPerMsg the Postgres and RabbitMQ servers' during the
	// row (-1: not measured), AllPerMsg the sum of the three.
	CPUPerMsg, PGPerMsg, MQPerMsg, AllPerMsg time.Duration
	// HTTP rows (Settled: requests answered): 2xx answers replayed, 409s,
	// and any other failure (an answer that is not 2xx, a socket error).
	Replayed, Conflicts, Failed int64
	// Note says why a row did not run, or what to know about its figure.
	Note string
}

// runKind is what runs a scenario.
type runKind int

const (
	runIdemqWorker runKind = iota // this binary re-executed (workerSpec)
	runBenchref                   // shared/benchref e2e
	runWatermill                  // bench/watermill
	runRiver                      // bench/river
)

// scenario is one line of a table.
type scenario struct {
	name       string
	kind       runKind
	mode       mode
	groupSize  int
	duplicates float64
	// consumer is the mode of an idemq row (mode modeIdemq).
	consumer consumer.Mode
	// concurrency and linger, when set, replace the run's concurrency and
	// the default linger (the shape of the reference consumer).
	concurrency int
	linger      time.Duration
	// work is benchref's e2e -work, or the Watermill peer's --dedup.
	work string
	// Publishing side: queue kind, relay batch, ratio group, bare row.
	classic bool
	batch   int
	group   string
	bare    bool
	// partitions, when set, makes an ordered row: the queue is
	// partitioned, the consumer ordered, and the messages carry
	// orderedKeys ordering keys and their sequences.
	partitions, orderedKeys int
	// pooled runs the row's worker through Options.PgBouncerURL.
	pooled bool
	// ref marks a run of the reference of the targets (benchref tx2).
	ref bool
	// server is what an HTTP row serves; paced adds the open-loop
	// latency at half the row's rate.
	server httpServer
	paced  bool
	// skip, when set, is why the row does not run.
	skip string
}

// benchSchema holds the tables of the idemq runs (dropped and made again).
const benchSchema = "idemq_bench"

// refWork is the benchref work of the reference of the targets, and
// refAgain the name of its second run.
const (
	refWork  = "tx2"
	refAgain = "benchref tx2, again"
)

// The targets of the consumer and publishing tables, as ratios: to the
// reference (the batch handler, the default mode), to the bare publisher
// into a quorum queue (the relay), to the bare pipe (forward).
const (
	targetBatch        = 1.00
	targetDefault      = 0.50
	targetDefaultLater = 0.70
	targetRelay        = 0.80
	targetForward      = 0.60
)

// refSchema holds benchref's tables (its search_path), riverSchema River's.
const (
	refSchema   = "idemq_bench_ref"
	riverSchema = "idemq_bench_river"
)

// bench is one run: its services, options and built peers.
type bench struct {
	o     Options
	pool  *pgxpool.Pool
	conn  *amqp.Connection
	probe *cpuProbe
	// benchref, watermill, river: built binaries ("" = not available).
	benchrefBin, watermillBin, riverBin string
	lastCPU                             serverCPU
}

// Run measures every scenario and prints the tables to out. When this
// process is a bench worker (re-executed by Run), it does the worker's job
// instead.
func Run(ctx context.Context, opts Options, out io.Writer) ([]Result, error) {
	if isWorker, err := maybeWorker(ctx); isWorker {
		return nil, err
	}
	o := opts.withDefaults()
	only, err := regexp.Compile(o.Only)
	if err != nil {
		return nil, fmt.Errorf("bench: --only: %w", err)
	}
	pool, err := pgxpool.New(ctx, o.PostgresURL)
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		return nil, fmt.Errorf("bench: cannot reach Postgres at %s (run `make up`): %s", redact.URL(o.PostgresURL), redact.Error(err))
	}
	defer pool.Close()
	unlock, err := lockRun(ctx, pool, out)
	if err != nil {
		return nil, err
	}
	defer unlock()
	conn, err := amqpdial.DialURL(ctx, o.AMQPURL, "idemq-bench", 0)
	if err != nil {
		return nil, fmt.Errorf("bench: cannot reach RabbitMQ at %s (run `make up`): %s", redact.URL(o.AMQPURL), redact.Error(err))
	}
	defer conn.Close()
	b := &bench{o: o, pool: pool, conn: conn, probe: newCPUProbe(o.PostgresURL, o.AMQPURL)}

	scenarios := []scenario{{name: "bare amqp091-go consume+ack", mode: modeBare}}
	for _, r := range []struct{ work, name string }{
		{"floor", "benchref floor: ledger rows, 1 tx, no dedup"},
		{"tx1", "benchref tx1: keys+ledger, 1 tx"},
		{"tx2", "benchref tx2: claim+ledger+complete, 1 tx"},
		{"dedup", "benchref dedup: claim, complete, no effect"},
	} {
		scenarios = append(scenarios, scenario{name: r.name, kind: runBenchref, work: r.work, ref: r.work == refWork})
	}
	// The per-message group rows run the library's default group size.
	g := consumer.DefaultGroupSize
	scenarios = append(scenarios,
		scenario{name: "idemq per-message (1 tx/msg)", mode: modeIdemq, consumer: consumer.ModeSingle, groupSize: 1},
		scenario{name: "idemq per-message, separate reservation", mode: modeIdemq, consumer: consumer.ModeSingleSeparate, groupSize: 1},
		scenario{name: fmt.Sprintf("idemq per-message, group commit %d", g), mode: modeIdemq, consumer: consumer.ModeGroup, groupSize: g},
		scenario{name: fmt.Sprintf("idemq group commit %d, separate reservations", g), mode: modeIdemq, consumer: consumer.ModeGroupSeparate, groupSize: g},
		scenario{name: fmt.Sprintf("idemq per-message, optimistic group %d", g), mode: modeIdemq, consumer: consumer.ModeOptimistic, groupSize: g},
		scenario{name: fmt.Sprintf("idemq optimistic %d, separate reservations", g), mode: modeIdemq, consumer: consumer.ModeOptimisticSeparate, groupSize: g},
		scenario{name: "idemq batch handler 100", mode: modeIdemq, consumer: consumer.ModeBatch, groupSize: 100},
		scenario{name: "idemq batch 100, separate reservations", mode: modeIdemq, consumer: consumer.ModeBatchSeparate, groupSize: 100},
		scenario{name: "idemq batch 100, 2 in flight, linger 5ms", mode: modeIdemq, consumer: consumer.ModeBatch, groupSize: 100, concurrency: 2, linger: 5 * time.Millisecond},
		scenario{name: fmt.Sprintf("idemq optimistic group %d, 20%% dup", g), mode: modeIdemq, consumer: consumer.ModeOptimistic, groupSize: g, duplicates: 0.2},
		scenario{name: "idemq batch 100, 20% dup", mode: modeIdemq, consumer: consumer.ModeBatch, groupSize: 100, duplicates: 0.2},
		scenario{name: fmt.Sprintf("idemq ordered, 4 partitions, 1000 keys, group %d", g), mode: modeIdemq, consumer: consumer.ModeGroup, groupSize: g, partitions: 4, orderedKeys: 1000},
	)
	if o.PgBouncerURL != "" {
		scenarios = append(scenarios,
			scenario{name: fmt.Sprintf("idemq per-message, group commit %d, via PgBouncer", g), mode: modeIdemq, consumer: consumer.ModeGroup, groupSize: g, pooled: true},
			scenario{name: "idemq batch handler 100, via PgBouncer", mode: modeIdemq, consumer: consumer.ModeBatch, groupSize: 100, pooled: true})
	}
	if o.WatermillDir != "" {
		scenarios = append(scenarios,
			scenario{name: "watermill + in-memory Deduplicator, 20% dup", kind: runWatermill, work: "memory", duplicates: 0.2},
			scenario{name: "watermill + Postgres Deduplicator + ledger, 20% dup", kind: runWatermill, work: "postgres", duplicates: 0.2})
	}
	if o.RiverDir != "" {
		scenarios = append(scenarios, scenario{name: fmt.Sprintf("river JobCompleteTx + ledger, %d workers", o.RiverWorkers), kind: runRiver})
	}
	// The bare consumer and the reference of the targets run first and
	// last: the ratios use the mean of both runs, so a machine that speeds
	// up or slows down during the run does not tilt them.
	scenarios = append(scenarios,
		scenario{name: refAgain, kind: runBenchref, work: refWork, ref: true},
		scenario{name: "bare amqp091-go, again", mode: modeBare})
	scenarios = selectRows(scenarios, only, func(sc scenario) bool { return sc.mode == modeBare || sc.ref })
	// Build the reference consumers and the peers of the rows that run
	// first, so that the rows run back to back in one window.
	skips := map[runKind]string{}
	for _, sc := range scenarios {
		if _, built := skips[sc.kind]; built {
			continue
		}
		switch sc.kind {
		case runBenchref:
			skips[sc.kind] = b.buildBenchref(ctx, out)
			if why := skips[sc.kind]; why != "" && o.BenchrefDir != "" {
				// Said before the rows run, not only under the table: a
				// full run without it has no ratios to the targets' base.
				fmt.Fprintf(out, "the reference consumers will not run (%s): the vs tx2 column and the consumer table's targets stay empty\n", why)
			}
		case runWatermill:
			skips[sc.kind] = b.buildPeer(ctx, out, o.WatermillDir, "bench-watermill", "Watermill peer", &b.watermillBin)
		case runRiver:
			skips[sc.kind] = b.buildPeer(ctx, out, o.RiverDir, "bench-river", "River peer", &b.riverBin)
		}
	}
	for i := range scenarios {
		scenarios[i].skip = skips[scenarios[i].kind]
	}

	start := time.Now()
	if len(scenarios) > 0 {
		fmt.Fprintf(out, "idemq bench: %d messages of %d bytes per scenario (at most %s each), quorum queues, prefetch %d, concurrency %d; load average %s\n",
			o.Messages, o.BodySize, o.MaxDuration, o.Prefetch, o.Concurrency, loadAverage())
	} else {
		fmt.Fprintf(out, "idemq bench: load average %s\n", loadAverage())
	}
	var results []Result
	for _, sc := range scenarios {
		r, err := b.runRow(ctx, out, sc, b.runScenario)
		if err != nil {
			return results, err
		}
		r.Section = SectionConsume
		results = append(results, r)
	}
	ratios(results, func(i int) bool { return scenarios[i].mode == modeBare && scenarios[i].kind == runIdemqWorker })
	refRatios(results, func(i int) bool { return scenarios[i].ref })

	var pubs []Result
	pubScenarios := selectRows(publishScenarios(), only, func(sc scenario) bool { return sc.bare })
	if !o.NoPublish && len(pubScenarios) > 0 {
		fmt.Fprintf(out, "publishing side: %d messages of %d bytes per scenario, confirms on every publish\n", o.Messages, o.BodySize)
		for _, sc := range pubScenarios {
			r, err := b.runRow(ctx, out, sc, b.runPublishScenario)
			if err != nil {
				return append(results, pubs...), err
			}
			r.Section = SectionPublish
			pubs = append(pubs, r)
		}
		groupRatios(pubScenarios, pubs)
	}
	var https []Result
	var paced []pacedHTTP
	if httpScenarios := selectRows(httpScenarios(), only, func(sc scenario) bool { return sc.bare }); !o.NoHTTP && len(httpScenarios) > 0 {
		var err error
		https, paced, err = b.runHTTPRows(ctx, out, httpScenarios)
		if err != nil {
			return slices.Concat(results, pubs, https), err
		}
	}
	fmt.Fprintf(out, "rows ran in %s; load average now %s\n", time.Since(start).Round(time.Second), loadAverage())

	var sweep []sweepPoint
	if o.Sweep {
		var err error
		sweep, err = runSweep(ctx, o, pool, conn, out)
		if err != nil {
			return results, err
		}
	}
	if len(results) > 0 {
		printTable(out, results, b.lastCPU)
	}
	if len(pubs) > 0 {
		printPublishTable(out, pubs)
	}
	if len(https) > 0 {
		printHTTPTable(out, https, paced)
	}
	if !o.NoPublish {
		if err := b.runWakeTable(ctx, out, only); err != nil {
			return slices.Concat(results, pubs, https), err
		}
	}
	if o.PlotPath != "" {
		if err := writePlot(o.PlotPath, results, sweep); err != nil {
			return results, err
		}
		fmt.Fprintf(out, "plot: %s\n", o.PlotPath)
	}
	return slices.Concat(results, pubs, https), nil
}

// selectRows keeps the rows of a table whose name only matches, with the
// base rows (isBase: the ratios' base) of their group; a group none of
// whose other rows matches is left out, and so is a table (nil).
func selectRows(scs []scenario, only *regexp.Regexp, isBase func(scenario) bool) []scenario {
	scs = slices.DeleteFunc(slices.Clone(scs), func(sc scenario) bool { return !isBase(sc) && !only.MatchString(sc.name) })
	kept := map[string]bool{}
	for _, sc := range scs {
		if !isBase(sc) {
			kept[sc.group] = true
		}
	}
	scs = slices.DeleteFunc(scs, func(sc scenario) bool { return !kept[sc.group] })
	if len(scs) == 0 {
		return nil
	}
	return scs
}

// runLockKey is the advisory lock that one run holds on its database: two
// runs would reset each other's schemas (and share the cores, which makes
// both sets of figures meaningless), so a second run waits for the first.
const runLockKey int64 = 0x69_64_65_6d_71_62_6e_63 // "idemqbnc"

func lockRun(ctx context.Context, pool *pgxpool.Pool, out io.Writer) (func(), error) {
	c, err := pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	var got bool
	if err := c.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", runLockKey).Scan(&got); err != nil {
		c.Release()
		return nil, fmt.Errorf("bench: lock: %w", err)
	}
	if !got {
		fmt.Fprintln(out, "waiting: another idemq bench is running on this database (its schemas are these)")
		if _, err := c.Exec(ctx, "SELECT pg_advisory_lock($1)", runLockKey); err != nil {
			c.Release()
			return nil, fmt.Errorf("bench: lock: %w", err)
		}
	}
	return func() {
		_, _ = c.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", runLockKey)
		c.Release()
	}, nil
}

func groups(scs []scenario) map[string]bool {
	g := map[string]bool{}
	for _, sc := range scs {
		g[sc.group] = true
	}
	return g
}

// groupRatios sets the ratio of each of rs (the results of scs, in
// order) to the bare rows of its scenario's group.
func groupRatios(scs []scenario, rs []Result) {
	for g := range groups(scs) {
		var idx []int
		var sub []Result
		for i, sc := range scs {
			if sc.group == g {
				idx = append(idx, i)
				sub = append(sub, rs[i])
			}
		}
		ratios(sub, func(j int) bool { return scs[idx[j]].bare })
		for j, i := range idx {
			rs[i].Ratio = sub[j].Ratio
		}
	}
}

// ratios sets each row's Ratio to its rate over the mean rate of the base
// rows (isBase(i)); rows without a base keep 0.
func ratios(rs []Result, isBase func(int) bool) {
	if base := meanRate(rs, isBase); base > 0 {
		for i := range rs {
			rs[i].Ratio = rs[i].Rate / base
		}
	}
}

// refRatios sets each row's RefRatio to its rate over the mean rate of the
// reference rows (isRef(i)); without one that ran, RefRatio stays 0.
func refRatios(rs []Result, isRef func(int) bool) {
	if base := meanRate(rs, isRef); base > 0 {
		for i := range rs {
			rs[i].RefRatio = rs[i].Rate / base
		}
	}
}

// meanRate is the mean rate of the rows that ran among those of isBase,
// or 0 when none did.
func meanRate(rs []Result, isBase func(int) bool) float64 {
	var sum float64
	var n int
	for i, r := range rs {
		if isBase(i) && r.Rate > 0 {
			sum += r.Rate
			n++
		}
	}
	if n == 0 {
		return 0
	}
	return sum / float64(n)
}

// printTargets prints a table's targets line, when it has any.
func printTargets(out io.Writer, targets []string) {
	if len(targets) > 0 {
		fmt.Fprintln(out, "targets: "+strings.Join(targets, "; "))
	}
}

// runRow prints the row's progress and measures it, with the servers' CPU
// read before and after.
func (b *bench) runRow(ctx context.Context, out io.Writer, sc scenario, run func(context.Context, scenario, func() measured) (Result, error)) (Result, error) {
	fmt.Fprintf(out, "  running %-55s", sc.name+" …")
	if sc.skip != "" {
		fmt.Fprintln(out, " not run")
		return Result{Scenario: sc.name, Note: sc.skip}, nil
	}
	r, err := run(ctx, sc, b.measure)
	if err != nil {
		fmt.Fprintln(out, "failed")
		return r, fmt.Errorf("bench: %s: %w", sc.name, err)
	}
	r.Scenario = sc.name
	if r.Note != "" && r.Rate == 0 {
		fmt.Fprintln(out, " failed (see the notes)")
	} else if sc.mode == modeHTTP {
		fmt.Fprintf(out, " %8.0f req/s\n", r.Rate)
	} else {
		fmt.Fprintf(out, " %8.0f msg/s\n", r.Rate)
	}
	return r, nil
}

// measured brackets the measured part of a row: start reads the servers'
// CPU, done reads it again and fills the CPU columns of r.
type measured struct {
	before serverCPU
	b      *bench
}

func (b *bench) measure() measured { return measured{before: b.probe.sample(), b: b} }

func (m measured) done(r *Result, res workerResult, usage *syscall.Rusage) {
	r.Settled = res.Settled
	if res.FirstToLast > 0 {
		r.Rate = float64(res.Settled) / time.Duration(res.FirstToLast).Seconds()
	}
	m.cost(r, res.Settled, usage)
}

// cost reads the servers' CPU again and fills the CPU columns of r, per
// one of the n messages (or requests).
func (m measured) cost(r *Result, settled int, usage *syscall.Rusage) {
	d := m.b.probe.sample().sub(m.before)
	m.b.lastCPU = d
	r.PGPerMsg, r.MQPerMsg = -1, -1
	if settled == 0 {
		return
	}
	n := time.Duration(settled)
	if usage != nil {
		r.PeakRSSKiB = usage.Maxrss
		r.CPUPerMsg = time.Duration(usage.Utime.Nano()+usage.Stime.Nano()) / n
	}
	r.AllPerMsg = r.CPUPerMsg
	if d.pg >= 0 {
		r.PGPerMsg = d.pg / n
		r.AllPerMsg += r.PGPerMsg
	}
	if d.mq >= 0 {
		r.MQPerMsg = d.mq / n
		r.AllPerMsg += r.MQPerMsg
	}
}

func lat(d time.Duration) string {
	if d == 0 {
		return "n/a"
	}
	return d.Round(100 * time.Microsecond).String()
}

func cpu(d time.Duration) string {
	if d < 0 {
		return "n/a"
	}
	return d.Round(time.Microsecond).String()
}

func printTable(out io.Writer, results []Result, last serverCPU) {
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "scenario\tmsg/s\tvs bare\tvs tx2\tp50\tp99\tpeak RSS\tCPU/msg\tpg/msg\tmq/msg\tall/msg\t")
	for _, r := range results {
		if r.Rate == 0 && r.Note != "" {
			fmt.Fprintf(tw, "%s\t-\t-\t-\t-\t-\t-\t-\t-\t-\t-\t\n", r.Scenario)
			continue
		}
		fmt.Fprintf(tw, "%s\t%.0f\t%.0f%%\t%s\t%s\t%s\t%d MiB\t%s\t%s\t%s\t%s\t\n", r.Scenario, r.Rate, 100*r.Ratio, percent(r.RefRatio),
			lat(r.P50), lat(r.P99), r.PeakRSSKiB/1024, cpu(r.CPUPerMsg), cpu(r.PGPerMsg), cpu(r.MQPerMsg), cpu(r.AllPerMsg))
	}
	tw.Flush()
	fmt.Fprintln(out, "vs bare: to the mean of the two bare runs (first and last). p50/p99: publish to ack of paced messages, after a warm-up (idemq: after the effect's commit). msg/s: first delivery to last settle (benchref: from its consume call).")
	fmt.Fprintln(out, "vs tx2: to the mean of the two runs of benchref tx2 (the reference of the targets), first and last.")
	fmt.Fprintln(out, "CPU/msg: the consumer process; pg/msg, mq/msg: the servers during the row ("+last.describe()+", whatever else uses them); all/msg: the three together.")
	var targets []string
	for _, r := range results {
		switch r.Scenario {
		case "idemq batch handler 100":
			targets = append(targets, target(fmt.Sprintf("batch handler ≥ %.0f%% of tx2", 100*targetBatch), r.RefRatio > 0, r.RefRatio >= targetBatch, percent(r.RefRatio)))
		case fmt.Sprintf("idemq per-message, group commit %d", consumer.DefaultGroupSize):
			targets = append(targets, target(fmt.Sprintf("default mode ≥ %.0f%% of tx2 (#32)", 100*targetDefault), r.RefRatio > 0, r.RefRatio >= targetDefault, percent(r.RefRatio)),
				target(fmt.Sprintf("≥ %.0f%% (#37)", 100*targetDefaultLater), r.RefRatio > 0, r.RefRatio >= targetDefaultLater, percent(r.RefRatio)))
		}
	}
	printTargets(out, targets)
	printNotes(out, results)
}

// percent prints a ratio, or "-" when there is none.
func percent(ratio float64) string {
	if ratio <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f%%", 100*ratio)
}

func printPublishTable(out io.Writer, results []Result) {
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "publishing side\tmsg/s\tvs bare\tpeak RSS\tCPU/msg\tpg/msg\tmq/msg\tall/msg\t")
	for _, r := range results {
		if r.Rate == 0 && r.Note != "" {
			fmt.Fprintf(tw, "%s\t-\t-\t-\t-\t-\t-\t-\t\n", r.Scenario)
			continue
		}
		fmt.Fprintf(tw, "%s\t%.0f\t%.0f%%\t%d MiB\t%s\t%s\t%s\t%s\t\n", r.Scenario, r.Rate, 100*r.Ratio,
			r.PeakRSSKiB/1024, cpu(r.CPUPerMsg), cpu(r.PGPerMsg), cpu(r.MQPerMsg), cpu(r.AllPerMsg))
	}
	tw.Flush()
	fmt.Fprintln(out, "vs bare: relay rows to the mean of the bare publisher runs into the same queue kind (before and after); forward to the mean of the two bare pipe runs. msg/s: worker start (connections included) to the last confirm recorded.")
	var targets []string
	for _, r := range results {
		switch r.Scenario {
		case "idemq relay batch 500, quorum":
			targets = append(targets, target(fmt.Sprintf("relay batch 500 into a quorum queue ≥ %.0f%% of bare", 100*targetRelay), r.Ratio > 0, r.Ratio >= targetRelay, percent(r.Ratio)))
		case "idemq forward: claim, outbox, relay":
			targets = append(targets, target(fmt.Sprintf("forward ≥ %.0f%% of the bare pipe", 100*targetForward), r.Ratio > 0, r.Ratio >= targetForward, percent(r.Ratio)))
		}
	}
	printTargets(out, targets)
	printNotes(out, results)
}

func printNotes(out io.Writer, results []Result) {
	for _, r := range results {
		if r.Note != "" {
			fmt.Fprintf(out, "  note: %s: %s\n", r.Scenario, r.Note)
		}
	}
}

// loadAverage is the 1, 5 and 15 minute load average, or "n/a".
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "n/a"
	}
	f := bytes.Fields(b)
	if len(f) < 3 {
		return "n/a"
	}
	return string(bytes.Join(f[:3], []byte(" ")))
}

// prepare gives a scenario a fresh queue (and for idemq, topology and schema).
func prepare(ctx context.Context, pool *pgxpool.Pool, conn *amqp.Connection, queue string, partitions int) error {
	if err := resetSchema(ctx, pool); err != nil {
		return err
	}
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	topo := benchTopology(queue, partitions).OnBroker(consumer.BrokerVersion(conn))
	queues, _ := topo.Names()
	for _, q := range queues {
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			return err
		}
	}
	return topo.Declare(ch)
}

// resetSchema drops and recreates the bench schema: idemq's tables and the
// ledger the handlers write.
func resetSchema(ctx context.Context, pool *pgxpool.Pool) error {
	if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+benchSchema+" CASCADE"); err != nil {
		return err
	}
	if err := schema.Migrate(ctx, pool, benchSchema); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, "CREATE TABLE "+benchSchema+".ledger (key text NOT NULL)")
	return err
}

// quiesce writes the dirty pages of the rows before out (CHECKPOINT), so a
// row does not pay for the previous one's writes. Refused without the
// privilege, which only makes the figures noisier.
func quiesce(ctx context.Context, pool *pgxpool.Pool) {
	_, _ = pool.Exec(ctx, "CHECKPOINT")
}

func benchConsumerConfig(queue string) consumer.Config {
	return consumer.Config{URL: "amqp://unused", Queue: queue, Name: "bench"}
}

// benchTopology is the topology of a row's queue (partitioned when
// partitions > 0).
func benchTopology(queue string, partitions int) consumer.Topology {
	cfg := benchConsumerConfig(queue)
	cfg.Partitions = partitions
	return consumer.NewTopology(cfg.TopologyConfig())
}

func tierNames(t consumer.Topology) []string {
	var out []string
	for _, d := range t.Delays {
		out = append(out, t.TierName(d))
	}
	return out
}

// publish loads n messages (unique keys, or a share of repeats) with
// confirms; paced adds the send time in a header and keeps to rate/s.
func publish(ctx context.Context, conn *amqp.Connection, queue string, n, size int, dup float64, prefix string, rate, orderedKeys int) error {
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		return err
	}
	body := bytes.Repeat([]byte("x"), size)
	rng := rand.New(rand.NewPCG(1, 2))
	var pending []*amqp.DeferredConfirmation
	flush := func() error {
		for _, c := range pending {
			if ok, err := c.WaitContext(ctx); err != nil || !ok {
				return fmt.Errorf("publish not confirmed (ack %v): %w", ok, err)
			}
		}
		pending = pending[:0]
		return nil
	}
	var tick *time.Ticker
	if rate > 0 {
		tick = time.NewTicker(time.Second / time.Duration(rate))
		defer tick.Stop()
	}
	unique := 0
	for i := range n {
		key := prefix + strconv.Itoa(unique)
		if i > 0 && dup > 0 && rng.Float64() < dup {
			key = prefix + strconv.Itoa(rng.IntN(unique))
		} else {
			unique++
		}
		msg := amqp.Publishing{MessageId: key, Body: body, DeliveryMode: amqp.Persistent, Headers: amqp.Table{}}
		exchange, routingKey := "", queue
		if orderedKeys > 0 {
			// Round robin over the keys: message i is event i/keys+1 of
			// key i%keys, published in order to the partitions' exchange.
			msg.Headers[consumer.HeaderOrderingKey] = prefix + "e" + strconv.Itoa(i%orderedKeys)
			msg.Headers[consumer.HeaderSequence] = int64(i/orderedKeys + 1)
			exchange, routingKey = consumer.OrderExchange(queue), ""
		}
		if tick != nil {
			<-tick.C
			msg.Headers[headerSent] = time.Now().UnixNano()
		}
		c, err := ch.PublishWithDeferredConfirmWithContext(ctx, exchange, routingKey, false, false, msg)
		if err != nil {
			return err
		}
		pending = append(pending, c)
		if len(pending) >= 1000 || tick != nil {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	return flush()
}

// runScenario runs one row of the consumer table: a fresh queue preloaded
// with the workload, the consumer measured draining it, then (for the bare
// and idemq workers) a paced phase for latency.
func (b *bench) runScenario(ctx context.Context, sc scenario, measure func() measured) (Result, error) {
	o := b.o
	queue := fmt.Sprintf("idemq.bench.%d", time.Now().UnixNano())
	if err := prepare(ctx, b.pool, b.conn, queue, sc.partitions); err != nil {
		return Result{}, err
	}
	defer cleanupQueue(b.conn, queue, sc.partitions)
	if sc.kind == runRiver {
		// River's jobs are its queue: inserted up front, outside the
		// measurement, by a process of their own.
		if err := b.riverInsert(ctx); err != nil {
			return Result{Note: err.Error()}, nil
		}
	} else if err := publish(ctx, b.conn, queue, o.Messages, o.BodySize, sc.duplicates, "k-", 0, sc.orderedKeys); err != nil {
		return Result{}, err
	}
	quiesce(ctx, b.pool)
	pgURL := o.PostgresURL
	if sc.pooled {
		pgURL = o.PgBouncerURL
	}
	spec := workerSpec{Mode: sc.mode, PostgresURL: pgURL, AMQPURL: o.AMQPURL, Schema: benchSchema, Queue: queue,
		Count: o.Messages, MaxDuration: o.MaxDuration, Concurrency: cmp.Or(sc.concurrency, o.Concurrency), Prefetch: o.Prefetch, GroupSize: sc.groupSize,
		Consumer: sc.consumer, Linger: sc.linger, Partitions: sc.partitions}
	var res workerResult
	var usage *syscall.Rusage
	var err error
	m := measure()
	switch sc.kind {
	case runBenchref:
		res, usage, err = b.runBenchref(ctx, queue, sc.work)
	case runWatermill:
		res, usage, err = b.runWatermill(ctx, queue, sc.work)
	case runRiver:
		res, usage, err = b.runRiver(ctx)
	default:
		res, usage, err = runWorkerProcess(ctx, spec)
	}
	var r Result
	if err != nil {
		if sc.kind == runIdemqWorker {
			return Result{}, err
		}
		// A reference or a peer that fails says so in its row; idemq's
		// own rows stop the run.
		return Result{Note: "failed: " + redact.Error(err)}, nil
	}
	m.done(&r, res, usage)
	r.Note = res.Note
	if sc.kind != runIdemqWorker {
		return r, nil
	}
	// Latency: a fresh queue, messages at a steady rate, well below capacity.
	if err := prepare(ctx, b.pool, b.conn, queue, sc.partitions); err != nil {
		return r, err
	}
	spec.Count, spec.MaxDuration = o.Paced, time.Duration(o.Paced/o.PacedRate+10)*time.Second
	type done struct {
		res workerResult
		err error
	}
	ch := make(chan done, 1)
	go func() {
		res, _, err := runWorkerProcess(ctx, spec)
		ch <- done{res, err}
	}()
	// Publish once the worker consumes: its start-up is not latency.
	watched := queue
	if sc.partitions > 0 {
		watched = consumer.PartitionQueue(queue, sc.partitions-1)
	}
	if err := waitConsumer(ctx, b.conn, watched, 15*time.Second); err != nil {
		return r, err
	}
	if err := publish(ctx, b.conn, queue, o.Paced, o.BodySize, 0, "p-", o.PacedRate, sc.orderedKeys); err != nil {
		return r, err
	}
	d := <-ch
	if d.err != nil {
		return r, d.err
	}
	// The first messages open the worker's connections: a warm-up, left out.
	lat := d.res.Latencies
	if warm := min(len(lat)/10, 30); warm > 0 {
		lat = lat[warm:]
	}
	r.P50, r.P99 = percentile(lat, 0.5), percentile(lat, 0.99)
	return r, nil
}

// cleanupQueue deletes a scenario's queues and dead-letter exchange, each
// on a channel of its own (a failed delete closes its channel).
func cleanupQueue(conn *amqp.Connection, queue string, partitions int) {
	queues, exchanges := benchTopology(queue, partitions).Names()
	for _, q := range queues {
		deleteQueue(conn, q)
	}
	for _, x := range exchanges {
		if ch, err := conn.Channel(); err == nil {
			_ = ch.ExchangeDelete(x, false, false)
			_ = ch.Close()
		}
	}
}

// runWorkerProcess re-executes this binary as a worker and reads its result.
func runWorkerProcess(ctx context.Context, spec workerSpec) (workerResult, *syscall.Rusage, error) {
	exe, err := os.Executable()
	if err != nil {
		return workerResult{}, nil, err
	}
	b, _ := json.Marshal(spec)
	cmd := exec.CommandContext(ctx, exe, os.Args[1:]...)
	cmd.Env = append(os.Environ(), workerEnv+"="+string(b))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	usage, err := runMeasured(cmd)
	if err != nil {
		return workerResult{}, nil, fmt.Errorf("worker: %w: %s", err, redact.String(stderr.String()))
	}
	var res workerResult
	if err := json.Unmarshal(lastLine(stdout.Bytes()), &res); err != nil {
		return res, nil, fmt.Errorf("worker output %q: %w", stdout.String(), err)
	}
	if res.Error != "" {
		return res, nil, errors.New("worker: " + redact.String(res.Error))
	}
	return res, usage, nil
}

func lastLine(b []byte) []byte {
	b = bytes.TrimSpace(b)
	if i := bytes.LastIndexByte(b, '\n'); i >= 0 {
		return b[i+1:]
	}
	return b
}

// waitConsumer waits until queue has a consumer.
func waitConsumer(ctx context.Context, conn *amqp.Connection, queue string, limit time.Duration) error {
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	deadline := time.Now().Add(limit)
	for {
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		if err != nil {
			return err
		}
		if q.Consumers > 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no consumer on %s after %s", queue, limit)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}
