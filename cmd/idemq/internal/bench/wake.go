package bench

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"regexp"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/outbox"
)

// The outbox commits table: how the relays' wake-up weighs on the commits
// of the transactions that enqueue. Writers commit transactions of one
// outbox row each, as fast as they can, and the rows differ only in how
// the relays hear of them:
//
//   - a NOTIFY in the transaction: the statement trigger of schemas before
//     migration 014, installed again in the row's scratch schema (what
//     Postgres does at such a commit: take the database-wide notify lock and
//     hold it through the WAL flush);
//   - after the commit: outbox.WakeAfterCommit, then outbox.Wake (what the
//     consumer runtime and idemhttp do);
//   - no wake-up at all (the relays would only poll): the ceiling.
//
// Each row then runs a relay (default poll, 1 s) and measures commit →
// delivered to a consumer over paced commits by the same writers.

const (
	wakeWriters = 16
	// wakeSpan is how long the writers commit as fast as they can.
	wakeSpan = 10 * time.Second
	// wakePaced is each writer's paced commits for the latency, with a
	// random pause of up to wakePause before each.
	wakePaced = 25
	wakePause = 20 * time.Millisecond
	// wakeSchema is the rows' scratch schema, made again for each.
	wakeSchema = "idemq_bench_wake"
)

type wakeMode int

const (
	wakeNone wakeMode = iota
	wakeInTx
	wakeAfter
)

type wakeScenario struct {
	name string
	mode wakeMode
}

// wakeScenarios are the rows, the ceiling first and last (the ratios' base).
func wakeScenarios() []wakeScenario {
	return []wakeScenario{
		{"no wake-up", wakeNone},
		{"NOTIFY in the transaction (the old trigger)", wakeInTx},
		{"wake after commit", wakeAfter},
		{"no wake-up, again", wakeNone},
	}
}

// wakeResult is one row's figures.
type wakeResult struct {
	name     string
	mode     wakeMode
	commits  int
	rate     float64 // commits/s
	ratio    float64 // rate over the mean of the no-wake-up rows
	p50, p99 time.Duration
}

// runWakeTable runs the rows that only selects (matched as "outbox
// commits, <row>"; the no-wake-up ones always, when any other runs) and
// prints the table.
func (b *bench) runWakeTable(ctx context.Context, out io.Writer, only *regexp.Regexp) error {
	scs := wakeScenarios()
	// --only matches "outbox commits, <row>".
	selected := func(sc wakeScenario) bool { return sc.mode != wakeNone && only.MatchString("outbox commits, "+sc.name) }
	if !slices.ContainsFunc(scs, selected) {
		return nil
	}
	scs = slices.DeleteFunc(scs, func(sc wakeScenario) bool { return sc.mode != wakeNone && !selected(sc) })
	fmt.Fprintf(out, "outbox commits: %d writers, one outbox row per transaction, %s each; then %d paced commits per writer with a relay (poll 1s); load average %s\n",
		wakeWriters, wakeSpan, wakePaced, loadAverage())
	var rs []wakeResult
	for _, sc := range scs {
		fmt.Fprintf(out, "  running %-55s", sc.name+" …")
		r, err := b.runWake(ctx, sc)
		if err != nil {
			fmt.Fprintln(out, "failed")
			return fmt.Errorf("bench: %s: %w", sc.name, err)
		}
		fmt.Fprintf(out, " %8.0f commits/s\n", r.rate)
		rs = append(rs, r)
	}
	var sum float64
	var n int
	for _, r := range rs {
		if r.mode == wakeNone {
			sum, n = sum+r.rate, n+1
		}
	}
	for i := range rs {
		rs[i].ratio = rs[i].rate / (sum / float64(n))
	}
	fmt.Fprintf(out, "load average now %s\n", loadAverage())
	printWakeTable(out, rs)
	return nil
}

func printWakeTable(out io.Writer, rs []wakeResult) {
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "outbox commits, %d writers\tcommits/s\tvs no wake-up\tcommit→publish p50\tp99\t\n", wakeWriters)
	for _, r := range rs {
		fmt.Fprintf(tw, "%s\t%.0f\t%.0f%%\t%s\t%s\t\n", r.name, r.rate, 100*r.ratio, ms(r.p50), ms(r.p99))
	}
	tw.Flush()
	fmt.Fprintln(out, "vs no wake-up: to the mean of the two no-wake-up runs. commit→publish: from the writer's COMMIT returning to the delivery to a consumer, relay polling every 1s besides (so about the poll without a wake-up).")
}

func ms(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d.Microseconds())/1000) }

// runWake measures one row in a fresh scratch schema.
func (b *bench) runWake(ctx context.Context, sc wakeScenario) (wakeResult, error) {
	r := wakeResult{name: sc.name, mode: sc.mode}
	cfg, err := pgxpool.ParseConfig(b.o.PostgresURL)
	if err != nil {
		return r, err
	}
	cfg.MaxConns = wakeWriters + 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return r, err
	}
	defer pool.Close()
	ident := pgx.Identifier{wakeSchema}.Sanitize()
	if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+ident+" CASCADE"); err != nil {
		return r, err
	}
	defer pool.Exec(context.WithoutCancel(ctx), "DROP SCHEMA IF EXISTS "+ident+" CASCADE") //nolint:errcheck // the next run drops it too
	if err := schema.Migrate(ctx, pool, wakeSchema); err != nil {
		return r, err
	}
	if sc.mode == wakeInTx {
		if _, err := pool.Exec(ctx, oldTrigger(ident)); err != nil {
			return r, fmt.Errorf("install the old trigger: %w", err)
		}
	}
	ob, err := outbox.New(pool, &outbox.Config{Schema: wakeSchema})
	if err != nil {
		return r, err
	}
	commit := func(ctx context.Context, msg outbox.Message) error {
		// The writer never NOTIFYs in its transaction: the trigger
		// does, in the old row.
		ctx = outbox.WakeAfterCommit(ctx)
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return ob.Enqueue(ctx, tx, msg) }); err != nil {
			return err
		}
		if sc.mode == wakeAfter {
			outbox.Wake(ctx)
		}
		return nil
	}

	// Throughput: as fast as they can for wakeSpan.
	var commits atomic.Int64
	tctx, cancel := context.WithTimeout(ctx, wakeSpan)
	defer cancel()
	start := time.Now()
	err = writers(func(w int) error {
		for i := 0; tctx.Err() == nil; i++ {
			if err := commit(ctx, outbox.Message{RoutingKey: "idemq.bench.wake.none", MessageID: fmt.Sprintf("t%d-%d", w, i)}); err != nil {
				return err
			}
			commits.Add(1)
		}
		return nil
	})
	elapsed := time.Since(start)
	if err != nil {
		return r, err
	}
	r.commits = int(commits.Load())
	r.rate = float64(r.commits) / elapsed.Seconds()
	if _, err := pool.Exec(ctx, "TRUNCATE "+ident+".outbox"); err != nil {
		return r, err
	}
	r.p50, r.p99, err = b.wakeLatency(ctx, ob, commit)
	return r, err
}

// writers runs fn for each of wakeWriters writers at once and returns the
// first error.
func writers(fn func(w int) error) error {
	var wg sync.WaitGroup
	errs := make([]error, wakeWriters)
	for w := range wakeWriters {
		wg.Go(func() { errs[w] = fn(w) })
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// wakeLatency runs a relay of ob and a consumer, commits wakePaced
// messages per writer at random moments, and returns the p50 and p99 of
// commit → delivery.
func (b *bench) wakeLatency(ctx context.Context, ob *outbox.Outbox, commit func(context.Context, outbox.Message) error) (p50, p99 time.Duration, err error) {
	queue := "idemq.bench.wake." + strconv.FormatInt(time.Now().UnixNano(), 10)
	if err := declarePlain(b.conn, queue, true); err != nil {
		return 0, 0, err
	}
	defer deleteQueue(b.conn, queue)
	ch, err := b.conn.Channel()
	if err != nil {
		return 0, 0, err
	}
	defer ch.Close()
	deliveries, err := ch.Consume(queue, "", true, false, false, false, nil)
	if err != nil {
		return 0, 0, err
	}
	relay, err := outbox.NewRelay(ob, b.o.AMQPURL, &outbox.RelayConfig{
		ConnectionName: "idemq-bench-wake-relay",
		Logger:         slog.New(slog.DiscardHandler),
	})
	if err != nil {
		return 0, 0, err
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- relay.Run(rctx) }()
	defer func() {
		stop()
		if rerr := <-done; err == nil && rerr != nil {
			err = rerr
		}
	}()

	var committed sync.Map // message id → time.Time
	total := wakeWriters * wakePaced
	lat := make([]time.Duration, 0, total)
	got := make(chan error, 1)
	go func() { got <- collect(deliveries, &committed, total, &lat) }()
	if err := writers(func(w int) error {
		for i := range wakePaced {
			time.Sleep(rand.N(wakePause)) // commits at random moments, not a synchronisation
			id := fmt.Sprintf("l%d-%d", w, i)
			if err := commit(ctx, outbox.Message{RoutingKey: queue, MessageID: id}); err != nil {
				return err
			}
			committed.Store(id, time.Now())
		}
		return nil
	}); err != nil {
		return 0, 0, err
	}
	select {
	case err := <-got:
		if err != nil {
			return 0, 0, err
		}
	case <-time.After(time.Minute):
		return 0, 0, fmt.Errorf("%d paced messages not all delivered within a minute", total)
	}
	slices.Sort(lat)
	q := func(f float64) time.Duration { return lat[min(len(lat)-1, int(f*float64(len(lat))))] }
	return q(0.50), q(0.99), nil
}

// collect reads total deliveries and appends commit → delivery of each to
// lat. A delivery may come before its writer recorded the commit's time
// (the relay is quick); its latency then counts as the time until the
// writer recorded it, which is at most a scheduling delay.
func collect(deliveries <-chan amqp.Delivery, committed *sync.Map, total int, lat *[]time.Duration) error {
	type arrival struct {
		id string
		at time.Time
	}
	var early []arrival
	for range total {
		d, ok := <-deliveries
		if !ok {
			return fmt.Errorf("consumer closed after %d of %d deliveries", len(*lat)+len(early), total)
		}
		now := time.Now()
		if t, ok := committed.Load(d.MessageId); ok {
			*lat = append(*lat, now.Sub(t.(time.Time)))
		} else {
			early = append(early, arrival{d.MessageId, now})
		}
	}
	for _, a := range early {
		if t, ok := committed.Load(a.id); ok {
			*lat = append(*lat, max(0, a.at.Sub(t.(time.Time))))
		} else {
			*lat = append(*lat, 0)
		}
	}
	return nil
}

// oldTrigger is the outbox's insert trigger as migration 002 made it and
// migration 014 dropped it.
func oldTrigger(ident string) string {
	return `CREATE FUNCTION ` + ident + `.outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(left(TG_TABLE_SCHEMA, 56) || '_outbox', '');
    RETURN NULL;
END
$$;
CREATE TRIGGER outbox_notify AFTER INSERT ON ` + ident + `.outbox
    FOR EACH STATEMENT EXECUTE FUNCTION ` + ident + `.outbox_notify();`
}
