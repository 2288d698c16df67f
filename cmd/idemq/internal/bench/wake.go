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
// The rows take turns, wakeRounds times wakeSpan each, so that a machine
// whose speed drifts during the run (other work beside it) does not tilt
// them. Each row then runs a relay (default poll, 1 s) and measures commit
// → delivered to a consumer over paced commits by the same writers.

const (
	wakeWriters = 16
	// wakeRounds × wakeSpan is how long each row's writers commit as fast
	// as they can, in turns with the other rows.
	wakeRounds = 5
	wakeSpan   = 3 * time.Second
	// wakePaced is each writer's paced commits for the latency, with a
	// random pause of up to wakePause before each.
	wakePaced = 25
	wakePause = 20 * time.Millisecond
	// wakeSchema prefixes the rows' scratch schemas, made again for each run.
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

// wakeScenarios are the rows, the ceiling (the ratios' base) last.
func wakeScenarios() []wakeScenario {
	return []wakeScenario{
		{"NOTIFY in the transaction (the old trigger)", wakeInTx},
		{"wake after commit", wakeAfter},
		{"no wake-up", wakeNone},
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
// commits, <row>"; the no-wake-up one always, when any other runs) and
// prints the table.
func (b *bench) runWakeTable(ctx context.Context, out io.Writer, only *regexp.Regexp) error {
	scs := wakeScenarios()
	// --only matches "outbox commits, <row>".
	selected := func(sc wakeScenario) bool { return sc.mode != wakeNone && only.MatchString("outbox commits, "+sc.name) }
	if !slices.ContainsFunc(scs, selected) {
		return nil
	}
	scs = slices.DeleteFunc(scs, func(sc wakeScenario) bool { return sc.mode != wakeNone && !selected(sc) })
	fmt.Fprintf(out, "outbox commits: %d writers, one outbox row per transaction, the rows in turns, %d × %s each; then %d paced commits per writer with a relay (poll 1s); load average %s\n",
		wakeWriters, wakeRounds, wakeSpan, wakePaced, loadAverage())
	rows := make([]*wakeRow, len(scs))
	for i, sc := range scs {
		row, err := b.newWakeRow(ctx, sc, i)
		if err != nil {
			return fmt.Errorf("bench: %s: %w", sc.name, err)
		}
		defer row.close(ctx)
		rows[i] = row
	}
	for round := range wakeRounds {
		fmt.Fprintf(out, "  round %d:", round+1)
		for _, row := range rows {
			n, d, err := row.commitFlat(ctx)
			if err != nil {
				fmt.Fprintln(out, " failed")
				return fmt.Errorf("bench: %s: %w", row.sc.name, err)
			}
			row.commits += n
			row.elapsed += d
			fmt.Fprintf(out, " %.0f", float64(n)/d.Seconds())
		}
		fmt.Fprintln(out, " commits/s")
	}
	rs := make([]wakeResult, len(rows))
	for i, row := range rows {
		fmt.Fprintf(out, "  latency of %-52s", row.sc.name+" …")
		p50, p99, err := row.latency(ctx, b)
		if err != nil {
			fmt.Fprintln(out, "failed")
			return fmt.Errorf("bench: %s: %w", row.sc.name, err)
		}
		fmt.Fprintf(out, " p50 %s\n", ms(p50))
		rs[i] = wakeResult{name: row.sc.name, mode: row.sc.mode, commits: row.commits,
			rate: float64(row.commits) / row.elapsed.Seconds(), p50: p50, p99: p99}
	}
	base := rs[len(rs)-1].rate
	for i := range rs {
		rs[i].ratio = rs[i].rate / base
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
	fmt.Fprintln(out, "commits/s: over all the row's turns. commit→publish: from the writer's COMMIT returning to the delivery to a consumer, relay polling every 1s besides (so about the poll without a wake-up).")
}

func ms(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d.Microseconds())/1000) }

// wakeRow is one row: its scratch schema, pool and outbox, and its count.
type wakeRow struct {
	sc      wakeScenario
	pool    *pgxpool.Pool
	ident   string
	ob      *outbox.Outbox
	commits int
	elapsed time.Duration
}

// newWakeRow makes row i's scratch schema (with the old trigger for the
// NOTIFY-in-the-transaction row) and its pool.
func (b *bench) newWakeRow(ctx context.Context, sc wakeScenario, i int) (*wakeRow, error) {
	cfg, err := pgxpool.ParseConfig(b.o.PostgresURL)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = wakeWriters + 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	name := wakeSchema + "_" + strconv.Itoa(i)
	row := &wakeRow{sc: sc, pool: pool, ident: pgx.Identifier{name}.Sanitize()}
	if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+row.ident+" CASCADE"); err != nil {
		pool.Close()
		return nil, err
	}
	if err := schema.Migrate(ctx, pool, name); err != nil {
		row.close(ctx)
		return nil, err
	}
	if sc.mode == wakeInTx {
		if _, err := pool.Exec(ctx, oldTrigger(row.ident)); err != nil {
			row.close(ctx)
			return nil, fmt.Errorf("install the old trigger: %w", err)
		}
	}
	if row.ob, err = outbox.New(pool, &outbox.Config{Schema: name}); err != nil {
		row.close(ctx)
		return nil, err
	}
	return row, nil
}

func (row *wakeRow) close(ctx context.Context) {
	_, _ = row.pool.Exec(context.WithoutCancel(ctx), "DROP SCHEMA IF EXISTS "+row.ident+" CASCADE")
	row.pool.Close()
}

// commit commits one transaction that enqueues msg, waking the relays as
// the row does.
func (row *wakeRow) commit(ctx context.Context, msg outbox.Message) error {
	// The writer never NOTIFYs in its transaction: the trigger does, in
	// the old row.
	ctx = outbox.WakeAfterCommit(ctx)
	if err := pgx.BeginFunc(ctx, row.pool, func(tx pgx.Tx) error { return row.ob.Enqueue(ctx, tx, msg) }); err != nil {
		return err
	}
	if row.sc.mode == wakeAfter {
		outbox.Wake(ctx)
	}
	return nil
}

// commitFlat has the writers commit as fast as they can for wakeSpan and
// returns how many commits they made in how long.
func (row *wakeRow) commitFlat(ctx context.Context) (int, time.Duration, error) {
	var commits atomic.Int64
	tctx, cancel := context.WithTimeout(ctx, wakeSpan)
	defer cancel()
	start := time.Now()
	err := writers(func(w int) error {
		for i := 0; tctx.Err() == nil; i++ {
			if err := row.commit(ctx, outbox.Message{RoutingKey: "idemq.bench.wake.none", MessageID: fmt.Sprintf("t%d-%d", w, i)}); err != nil {
				return err
			}
			commits.Add(1)
		}
		return nil
	})
	return int(commits.Load()), time.Since(start), err
}

// latency empties the row's outbox and measures commit → delivery
// (wakeLatency).
func (row *wakeRow) latency(ctx context.Context, b *bench) (p50, p99 time.Duration, err error) {
	if _, err := row.pool.Exec(ctx, "TRUNCATE "+row.ident+".outbox"); err != nil {
		return 0, 0, err
	}
	return b.wakeLatency(ctx, row.ob, row.commit)
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
