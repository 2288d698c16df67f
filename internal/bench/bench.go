// Package bench measures idemq against a bare RabbitMQ consumer in one run:
// the same queue kind, message shape and prefetch, each consumer in a
// process of its own so that its memory and CPU are its own.
package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
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
	// WatermillDir is the source of the peer (bench/watermill); "" skips it.
	WatermillDir string
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
	return o
}

// Result is one scenario's figures.
type Result struct {
	Scenario   string
	Settled    int
	Rate       float64 // messages settled per second
	Ratio      float64 // Rate over the bare consumer's
	P50, P99   time.Duration
	PeakRSSKiB int64
	CPUPerMsg  time.Duration
	Note       string
}

// scenario is one line of the table.
type scenario struct {
	name       string
	mode       mode
	groupSize  int
	duplicates float64
	optimistic bool
	watermill  bool
}

const schema = "idemq_bench"

// Run measures every scenario and prints the table to out. When this process
// is a bench worker (re-executed by Run), it does the worker's job instead.
func Run(ctx context.Context, opts Options, out io.Writer) ([]Result, error) {
	if isWorker, err := maybeWorker(ctx); isWorker {
		return nil, err
	}
	o := opts.withDefaults()
	pool, err := pgxpool.New(ctx, o.PostgresURL)
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		return nil, fmt.Errorf("bench: cannot reach Postgres at %s (run `make up`): %s", redact.URL(o.PostgresURL), redact.Error(err))
	}
	defer pool.Close()
	conn, err := amqp.Dial(o.AMQPURL)
	if err != nil {
		return nil, fmt.Errorf("bench: cannot reach RabbitMQ at %s (run `make up`): %s", redact.URL(o.AMQPURL), redact.Error(err))
	}
	defer conn.Close()

	scenarios := []scenario{
		{name: "bare amqp091-go consume+ack", mode: modeBare},
		{name: "idemq per-message (1 tx/msg)", mode: modeSingle, groupSize: 1},
		{name: "idemq per-message, group commit 32", mode: modeGroup, groupSize: 32},
		{name: "idemq per-message, optimistic group 32", mode: modeGroup, groupSize: 32, optimistic: true},
		{name: "idemq batch handler 100", mode: modeBatch, groupSize: 100},
		{name: "idemq optimistic group 32, 20% dup", mode: modeGroup, groupSize: 32, optimistic: true, duplicates: 0.2},
		{name: "idemq batch 100, 20% dup", mode: modeBatch, groupSize: 100, duplicates: 0.2},
	}
	if o.WatermillDir != "" {
		if _, err := os.Stat(filepath.Join(o.WatermillDir, "go.mod")); err != nil {
			fmt.Fprintf(out, "(the Watermill peer is skipped: no module at %s; run from the repository root)\n", o.WatermillDir)
			o.WatermillDir = ""
		}
	}
	if o.WatermillDir != "" {
		scenarios = append(scenarios, scenario{name: "watermill + Deduplicator, 20% dup", watermill: true, duplicates: 0.2})
	}
	// The bare consumer runs first and last: the ratios use the mean of
	// both, so a machine that speeds up or slows down during the run
	// does not tilt them.
	scenarios = append(scenarios, scenario{name: "bare amqp091-go, again", mode: modeBare})
	fmt.Fprintf(out, "idemq bench: %d messages of %d bytes per scenario (at most %s each), quorum queues, prefetch %d, concurrency %d\n",
		o.Messages, o.BodySize, o.MaxDuration, o.Prefetch, o.Concurrency)
	var results []Result
	var bareSum float64
	var bareRuns int
	for _, sc := range scenarios {
		fmt.Fprintf(out, "  running %-40s", sc.name+" …")
		r, err := runScenario(ctx, o, pool, conn, sc)
		if err != nil {
			fmt.Fprintln(out, "failed")
			return results, fmt.Errorf("bench: %s: %w", sc.name, err)
		}
		if sc.mode == modeBare {
			bareSum += r.Rate
			bareRuns++
		}
		fmt.Fprintf(out, " %8.0f msg/s\n", r.Rate)
		results = append(results, r)
	}
	if bare := bareSum / float64(max(1, bareRuns)); bare > 0 {
		for i := range results {
			results[i].Ratio = results[i].Rate / bare
		}
	}
	var sweep []sweepPoint
	if o.Sweep {
		sweep, err = runSweep(ctx, o, pool, conn, out)
		if err != nil {
			return results, err
		}
	}
	printTable(out, results)
	if o.PlotPath != "" {
		if err := writePlot(o.PlotPath, results, sweep); err != nil {
			return results, err
		}
		fmt.Fprintf(out, "plot: %s\n", o.PlotPath)
	}
	return results, nil
}

func printTable(out io.Writer, results []Result) {
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "scenario\tmsg/s\tvs bare\tp50\tp99\tpeak RSS\tCPU/msg\t")
	lat := func(d time.Duration) string {
		if d == 0 {
			return "n/a"
		}
		return d.Round(100 * time.Microsecond).String()
	}
	for _, r := range results {
		fmt.Fprintf(tw, "%s\t%.0f\t%.0f%%\t%s\t%s\t%d MiB\t%s\t\n", r.Scenario, r.Rate, 100*r.Ratio,
			lat(r.P50), lat(r.P99), r.PeakRSSKiB/1024, r.CPUPerMsg.Round(time.Microsecond))
	}
	tw.Flush()
	fmt.Fprintln(out, "vs bare: to the mean of the two bare runs (first and last). p50/p99: publish to ack of paced messages, after a warm-up (idemq: after the effect's commit). msg/s: first delivery to last settle.")
}

// prepare gives a scenario a fresh queue (and for idemq, topology and schema).
func prepare(ctx context.Context, pool *pgxpool.Pool, conn *amqp.Connection, queue string) error {
	if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+schema+" CASCADE"); err != nil {
		return err
	}
	if err := dedup.Migrate(ctx, pool, schema); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE "+schema+".ledger (key text NOT NULL)"); err != nil {
		return err
	}
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	cfg := benchConsumerConfig(queue)
	topo := consumer.NewTopology(&cfg)
	for _, q := range append(tierNames(topo), topo.Queue, topo.DLQ) {
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			return err
		}
	}
	return topo.Declare(ch)
}

func benchConsumerConfig(queue string) consumer.Config {
	return consumer.Config{URL: "amqp://unused", Queue: queue, Name: "bench"}
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
func publish(ctx context.Context, conn *amqp.Connection, queue string, n, size int, dup float64, prefix string, rate int) error {
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
		msg := amqp.Publishing{MessageId: key, Body: body, DeliveryMode: amqp.Persistent}
		if tick != nil {
			<-tick.C
			msg.Headers = amqp.Table{headerSent: time.Now().UnixNano()}
		}
		c, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, false, false, msg)
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

func runScenario(ctx context.Context, o Options, pool *pgxpool.Pool, conn *amqp.Connection, sc scenario) (Result, error) {
	queue := fmt.Sprintf("idemq.bench.%d", time.Now().UnixNano())
	if err := prepare(ctx, pool, conn, queue); err != nil {
		return Result{}, err
	}
	defer cleanupQueue(conn, queue)
	if err := publish(ctx, conn, queue, o.Messages, o.BodySize, sc.duplicates, "k-", 0); err != nil {
		return Result{}, err
	}
	spec := workerSpec{Mode: sc.mode, PostgresURL: o.PostgresURL, AMQPURL: o.AMQPURL, Schema: schema, Queue: queue,
		Count: o.Messages, MaxDuration: o.MaxDuration, Concurrency: o.Concurrency, Prefetch: o.Prefetch, GroupSize: sc.groupSize,
		Optimistic: sc.optimistic}
	var res workerResult
	var usage *syscall.Rusage
	var err error
	if sc.watermill {
		res, usage, err = runWatermill(ctx, o, queue)
	} else {
		res, usage, err = runWorkerProcess(ctx, spec)
	}
	if err != nil {
		return Result{}, err
	}
	r := Result{Scenario: sc.name, Settled: res.Settled}
	if res.FirstToLast > 0 {
		r.Rate = float64(res.Settled) / time.Duration(res.FirstToLast).Seconds()
	}
	if usage != nil {
		r.PeakRSSKiB = usage.Maxrss
		cpu := time.Duration(usage.Utime.Nano() + usage.Stime.Nano())
		if res.Settled > 0 {
			r.CPUPerMsg = cpu / time.Duration(res.Settled)
		}
	}
	if sc.watermill {
		return r, nil
	}
	// Latency: a fresh queue, messages at a steady rate, well below capacity.
	if err := prepare(ctx, pool, conn, queue); err != nil {
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
	if err := waitConsumer(ctx, conn, queue, 15*time.Second); err != nil {
		return r, err
	}
	if err := publish(ctx, conn, queue, o.Paced, o.BodySize, 0, "p-", o.PacedRate); err != nil {
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

func cleanupQueue(conn *amqp.Connection, queue string) {
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	defer ch.Close()
	cfg := benchConsumerConfig(queue)
	topo := consumer.NewTopology(&cfg)
	for _, q := range append(tierNames(topo), topo.Queue, topo.DLQ) {
		_, _ = ch.QueueDelete(q, false, false, false)
	}
	_ = ch.ExchangeDelete(topo.DLX, false, false)
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
	if err := cmd.Run(); err != nil {
		return workerResult{}, nil, fmt.Errorf("worker: %w: %s", err, redact.String(stderr.String()))
	}
	var res workerResult
	if err := json.Unmarshal(lastLine(stdout.Bytes()), &res); err != nil {
		return res, nil, fmt.Errorf("worker output %q: %w", stdout.String(), err)
	}
	if res.Error != "" {
		return res, nil, errors.New("worker: " + redact.String(res.Error))
	}
	usage, _ := cmd.ProcessState.SysUsage().(*syscall.Rusage)
	return res, usage, nil
}

func lastLine(b []byte) []byte {
	b = bytes.TrimSpace(b)
	if i := bytes.LastIndexByte(b, '\n'); i >= 0 {
		return b[i+1:]
	}
	return b
}

// runWatermill builds (once) and runs the peer from bench/watermill.
func runWatermill(ctx context.Context, o Options, queue string) (workerResult, *syscall.Rusage, error) {
	cache, err := os.UserCacheDir()
	if err != nil {
		cache = os.TempDir()
	}
	bin := filepath.Join(cache, "idemq", "bench-watermill")
	build := exec.CommandContext(ctx, "go", "build", "-o", bin, ".")
	build.Dir = o.WatermillDir
	build.Env = append(os.Environ(), "GOWORK=off")
	if out, err := build.CombinedOutput(); err != nil {
		return workerResult{}, nil, fmt.Errorf("build watermill peer: %w: %s", err, out)
	}
	cmd := exec.CommandContext(ctx, bin, "--amqp-url", o.AMQPURL, "--queue", queue, "--count", strconv.Itoa(o.Messages),
		"--prefetch", strconv.Itoa(o.Prefetch))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return workerResult{}, nil, fmt.Errorf("watermill peer: %w: %s", err, redact.String(stderr.String()))
	}
	var wm struct {
		Handled      int   `json:"handled"`
		Deduplicated int   `json:"deduplicated"`
		FirstToLast  int64 `json:"first_to_last_ns"`
	}
	if err := json.Unmarshal(lastLine(stdout.Bytes()), &wm); err != nil {
		return workerResult{}, nil, fmt.Errorf("watermill output %q: %w", stdout.String(), err)
	}
	usage, _ := cmd.ProcessState.SysUsage().(*syscall.Rusage)
	return workerResult{Settled: wm.Handled + wm.Deduplicated, FirstToLast: wm.FirstToLast}, usage, nil
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
