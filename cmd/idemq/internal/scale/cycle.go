package scale

import (
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/dedup"
)

// Cycle is what one cycle measured.
type Cycle struct {
	N int
	// Worker is the worker's view, per phase: quiet, GC deleting, GC
	// vacuuming (by what GC did when an operation began).
	Ops      [phases]int
	Secs     [phases]float64
	P50, P99 [phases]time.Duration
	// OpsGC and P99GC are the worker's operations and p99 while GC ran,
	// deleting or vacuuming.
	OpsGC  int
	P99GC  time.Duration
	Errors [phases]int
	// FirstError is the first of the cycle's worker errors, nil without.
	FirstError error
	// LockWait is the longest lock wait of a worker statement.
	LockWait [phases]time.Duration
	// LockKind is the locktype of the longest wait (pg_locks).
	LockKind [phases]string
	Missed   int
	// WAL is the WAL the server wrote while GC ran (the worker's share
	// included), in bytes.
	WAL int64
	// Checkpoints counts the server's checkpoints that ended during the
	// cycle (timed and requested), CheckpointsGC those that ended while GC
	// ran: a checkpoint's last writes and fsyncs can move a p99 on their own.
	Checkpoints, CheckpointsGC int64
	// GC: keys and outbox rows deleted, and how long each took.
	GCKeys, GCOutbox         int64
	GCKeysTook, GCOutboxTook time.Duration
	// Vacuumed is the time GC's VACUUMs took, in both tables (Options.GCVacuum).
	Vacuumed time.Duration
	// Behind is how far the oldest key still due lay past the horizon when
	// GC ended (0 when GC kept up), as GC reports it.
	Behind time.Duration
	Sizes  Sizes
	Load1  string
	// lat are the worker's latencies per phase, sorted, for Overall.
	lat [phases][]time.Duration
}

// Sizes are the storage figures of both tables.
type Sizes struct {
	Keys, Outbox Table
}

// Table is one table's storage and vacuum figures.
type Table struct {
	Heap, Indexes, Total int64
	Live, Dead           int64
	// Autovacuums and Vacuums count the table's autovacuum and VACUUM runs.
	Autovacuums, Vacuums int64
	Vacuuming            bool
	// Index is the size of each of the table's indexes, by name.
	Index []Index
}

// Index is one index's name and size.
type Index struct {
	Name string
	Size int64
}

func sizes(ctx context.Context, pool *pgxpool.Pool, schema string) (Sizes, error) {
	var s Sizes
	// The outbox's retention works on the record of published messages.
	for name, t := range map[string]*Table{"keys": &s.Keys, "outbox_published": &s.Outbox} {
		err := pool.QueryRow(ctx, `SELECT pg_relation_size(c.oid), pg_indexes_size(c.oid), pg_total_relation_size(c.oid),
    coalesce(st.n_live_tup, 0), coalesce(st.n_dead_tup, 0), coalesce(st.autovacuum_count, 0), coalesce(st.vacuum_count, 0),
    EXISTS (SELECT FROM pg_stat_progress_vacuum v WHERE v.relid = c.oid)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_stat_user_tables st ON st.relid = c.oid
WHERE n.nspname = $1 AND c.relname = $2`, schema, name).Scan(&t.Heap, &t.Indexes, &t.Total, &t.Live, &t.Dead, &t.Autovacuums, &t.Vacuums, &t.Vacuuming)
		if err != nil {
			return s, fmt.Errorf("scale: sizes of %s: %w", name, err)
		}
		rows, err := pool.Query(ctx, `SELECT indexrelname, pg_relation_size(indexrelid) FROM pg_stat_user_indexes
WHERE schemaname = $1 AND relname = $2 ORDER BY pg_relation_size(indexrelid) DESC, indexrelname`, schema, name)
		if err != nil {
			return s, fmt.Errorf("scale: index sizes of %s: %w", name, err)
		}
		t.Index, err = pgx.CollectRows(rows, pgx.RowToStructByPos[Index])
		if err != nil {
			return s, fmt.Errorf("scale: index sizes of %s: %w", name, err)
		}
	}
	return s, nil
}

// cycles runs the worker for o.Cycles cycles; in each, GC runs once, from
// the middle of the cycle, asked to retire what the worker added so far.
func cycles(ctx context.Context, p *pools, o Options, l LoadResult) ([]Cycle, error) {
	store, err := newStore(p.worker, o)
	if err != nil {
		return nil, err
	}
	ob, err := newOutbox(p.worker, o)
	if err != nil {
		return nil, err
	}
	gcStore, err := newStore(p.gc, o)
	if err != nil {
		return nil, err
	}
	gcOutbox, err := newOutbox(p.gc, o)
	if err != nil {
		return nil, err
	}
	rec := &recorder{}
	w := &worker{o: o, pool: p.worker, store: store, ob: ob, rec: rec}
	w.retired.Store(int64(min(l.Retired, o.Keys)))
	wctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { w.run(wctx) })
	wg.Go(func() { markPublished(wctx, p.admin, o) })
	wg.Go(func() { sampleLockWaits(wctx, p.admin, rec) })
	wg.Go(func() { followVacuum(wctx, p.admin, o.Schema, rec) })
	defer func() { stop(); wg.Wait() }()

	lastCkpt, err := checkpoints(ctx, p.admin)
	if err != nil {
		return nil, err
	}
	var res []Cycle
	for n := 1; n <= o.Cycles; n++ {
		start := time.Now()
		c := Cycle{N: n}
		// First half: the worker alone.
		if err := sleep(ctx, o.Cycle/2); err != nil {
			return res, err
		}
		// GC, asked to retire as many of the oldest keys as the worker
		// added: the horizon moves to the creation time of the key that
		// many places into the day (past it, see retention).
		retireTo := l.Retired + int(w.inserted.Load())
		retention, err := retentionFor(ctx, p.gc, o.Schema, &l, retireTo)
		if err != nil {
			return res, err
		}
		w.retired.Store(int64(min(retireTo, o.Keys)))
		if err := retired(ctx, p.admin, o.Schema, retireTo, l.Retention); err != nil {
			return res, err
		}
		walStart, err := walPosition(ctx, p.admin)
		if err != nil {
			return res, err
		}
		ckptGC, err := checkpoints(ctx, p.admin)
		if err != nil {
			return res, err
		}
		gcStart := time.Now()
		rec.phase.Store(phaseDelete)
		keys, err := gcStore.GC(ctx, dedup.GCOptions{Retention: retention, Pause: o.GCPause, Vacuum: o.GCVacuum})
		c.GCKeysTook = time.Since(gcStart)
		if err != nil {
			return res, err
		}
		c.GCKeys = keys.Completed + keys.Abandoned
		c.Vacuumed = keys.Vacuumed
		c.Behind = keys.Behind
		obStart := time.Now()
		obRes, err := gcOutbox.GC(ctx, dedup.GCOptions{Retention: retention, Batch: o.GCBatch, Pause: o.GCPause, Vacuum: o.GCVacuum})
		c.GCOutboxTook = time.Since(obStart)
		c.GCOutbox = obRes.Deleted
		c.Vacuumed += obRes.Vacuumed
		rec.phase.Store(phaseQuiet)
		if err != nil {
			return res, err
		}
		gcTook := time.Since(gcStart)
		walEnd, err := walPosition(ctx, p.admin)
		if err != nil {
			return res, err
		}
		c.WAL = walEnd - walStart
		ckptEnd, err := checkpoints(ctx, p.admin)
		if err != nil {
			return res, err
		}
		c.CheckpointsGC = ckptEnd - ckptGC
		// The rest of the cycle: the worker alone again.
		if err := sleep(ctx, time.Until(start.Add(o.Cycle))); err != nil {
			return res, err
		}
		win := rec.take()
		quiet := time.Since(start) - gcTook
		c.Secs = [phases]float64{quiet.Seconds(), (gcTook - c.Vacuumed).Seconds(), c.Vacuumed.Seconds()}
		for ph := range phases {
			c.Ops[ph] = len(win.lat[ph])
			c.P50[ph], c.P99[ph] = quantile(win.lat[ph], 0.5), quantile(win.lat[ph], 0.99)
			c.Errors[ph] = win.errs[ph]
			c.LockWait[ph], c.LockKind[ph] = win.wait[ph], win.waitKind[ph]
		}
		c.lat, c.FirstError = win.lat, win.firstErr
		gc := slices.Concat(win.lat[phaseDelete], win.lat[phaseVacuum])
		slices.Sort(gc)
		c.OpsGC, c.P99GC = len(gc), quantile(gc, 0.99)
		c.Missed = win.missed
		ckpt, err := checkpoints(ctx, p.admin)
		if err != nil {
			return res, err
		}
		c.Checkpoints, lastCkpt = ckpt-lastCkpt, ckpt
		if c.Sizes, err = sizes(ctx, p.admin, o.Schema); err != nil {
			return res, err
		}
		c.Load1 = loadAverage()
		res = append(res, c)
		fmt.Fprintf(o.Log, "cycle %d: %s\n", n, strings.ReplaceAll(c.line(), "\t", " "))
	}
	return res, nil
}

// walPosition is the server's current WAL position, in bytes.
func walPosition(ctx context.Context, pool *pgxpool.Pool) (int64, error) {
	var n int64
	if err := pool.QueryRow(ctx, "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").Scan(&n); err != nil {
		return 0, fmt.Errorf("scale: WAL position: %w", err)
	}
	return n, nil
}

// checkpoints is the server's count of checkpoints so far.
func checkpoints(ctx context.Context, pool *pgxpool.Pool) (int64, error) {
	var n int64
	if err := pool.QueryRow(ctx, "SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter").Scan(&n); err != nil {
		return 0, fmt.Errorf("scale: checkpoints: %w", err)
	}
	return n, nil
}

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// loadAverage is the one-minute load average, "?" where it cannot be read.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return "?"
	}
	return f[0]
}

// printCycles prints the per-cycle table.
func printCycles(out io.Writer, cs []Cycle) {
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "cycle\tops/s\tp99\tops/s GC\tp99 GC\tΔp99\tp99 del\tp99 vac\tlock wait\tlock wait GC\tGC keys\tkeys/s\tGC outbox\trows/s\tvacuum\tGC WAL\tbehind\tckpt/GC\tkeys heap\tidx\tdead\tav/vac\tpublished heap\tidx\tdead\tav/vac\tload\t")
	for _, c := range cs {
		fmt.Fprintln(tw, c.line())
	}
	_ = tw.Flush()
}

// rateQuiet and rateGC are the worker's operations a second without and with GC.
func (c Cycle) rateQuiet() float64 {
	return perSec(int64(c.Ops[phaseQuiet]), time.Duration(c.Secs[phaseQuiet]*float64(time.Second)))
}

func (c Cycle) rateGC() float64 {
	return perSec(int64(c.OpsGC), time.Duration((c.Secs[phaseDelete]+c.Secs[phaseVacuum])*float64(time.Second)))
}

// DeltaP99 is how much GC raised the worker's p99, in percent of the quiet p99.
func (c Cycle) DeltaP99() float64 {
	if c.P99[phaseQuiet] <= 0 {
		return 0
	}
	return 100 * (float64(c.P99GC) - float64(c.P99[phaseQuiet])) / float64(c.P99[phaseQuiet])
}

func (c Cycle) line() string {
	k, ob := c.Sizes.Keys, c.Sizes.Outbox
	return fmt.Sprintf("%d\t%.0f\t%s\t%.0f\t%s\t%+.0f%%\t%s\t%s\t%s\t%s\t%d\t%.0f\t%d\t%.0f\t%s\t%s\t%s\t%d/%d\t%s\t%s\t%d\t%d/%d%s\t%s\t%s\t%d\t%d/%d%s\t%s\t",
		c.N, c.rateQuiet(), ms(c.P99[phaseQuiet]), c.rateGC(), ms(c.P99GC), c.DeltaP99(),
		msOrNone(c.P99[phaseDelete], c.Ops[phaseDelete]), msOrNone(c.P99[phaseVacuum], c.Ops[phaseVacuum]),
		c.lockWait(phaseQuiet), c.lockWaitGC(),
		c.GCKeys, perSec(c.GCKeys, c.GCKeysTook), c.GCOutbox, perSec(c.GCOutbox, c.GCOutboxTook),
		c.Vacuumed.Round(100*time.Millisecond), mb(c.WAL), c.Behind.Round(time.Second), c.Checkpoints, c.CheckpointsGC,
		mb(k.Heap), mb(k.Indexes), k.Dead, k.Autovacuums, k.Vacuums, running(k.Vacuuming),
		mb(ob.Heap), mb(ob.Indexes), ob.Dead, ob.Autovacuums, ob.Vacuums, running(ob.Vacuuming), c.Load1)
}

// msOrNone is d in milliseconds, or "-" where a phase had no operations.
func msOrNone(d time.Duration, ops int) string {
	if ops == 0 {
		return "-"
	}
	return ms(d)
}

// lockWaitGC is the longest lock wait while GC ran, and its lock type.
func (c Cycle) lockWaitGC() string {
	if c.LockWait[phaseVacuum] > c.LockWait[phaseDelete] {
		return c.lockWait(phaseVacuum)
	}
	return c.lockWait(phaseDelete)
}

// lockWait is the longest lock wait of a phase and its lock type.
func (c Cycle) lockWait(ph int) string {
	if c.LockWait[ph] == 0 {
		return "0"
	}
	return ms(c.LockWait[ph]) + " " + c.LockKind[ph]
}

func running(b bool) string {
	if b {
		return "*"
	}
	return ""
}

func perSec(n int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / d.Seconds()
}

func ms(d time.Duration) string {
	return fmt.Sprintf("%.1fms", float64(d)/float64(time.Millisecond))
}

func mb(b int64) string {
	return fmt.Sprintf("%.0fM", float64(b)/(1<<20))
}

func printHeader(out io.Writer, o Options, r Result) {
	how := "loaded in " + r.Load.Took.Round(time.Second).String()
	if r.Load.Reused {
		how = fmt.Sprintf("taken over from an earlier run (%d of its keys retired before)", r.Load.Retired)
	}
	fmt.Fprintf(out, "scale: %d keys and %d published outbox messages over a simulated day (schema %s), %s\n",
		r.Load.Keys, r.Load.Outbox, o.Schema, how)
	fmt.Fprintf(out, "worker: %d ops/s on %d connections, %.0f%% duplicates; GC: batch %d, pause %s, vacuum %v, once a cycle of %s from its middle\n",
		o.Rate, o.Concurrency, 100*o.Duplicates, o.GCBatch, o.GCPause, o.GCVacuum, o.Cycle)
	fmt.Fprintln(out)
}

func (s Sizes) String() string {
	return fmt.Sprintf("keys heap %s idx %s (%d live, %d dead); published heap %s idx %s (%d live, %d dead)\n       indexes %s",
		mb(s.Keys.Heap), mb(s.Keys.Indexes), s.Keys.Live, s.Keys.Dead,
		mb(s.Outbox.Heap), mb(s.Outbox.Indexes), s.Outbox.Live, s.Outbox.Dead, indexSizes(s.Keys.Index, s.Outbox.Index))
}

// indexSizes lists the indexes that hold anything, with their sizes.
func indexSizes(lists ...[]Index) string {
	var parts []string
	for _, l := range lists {
		for _, ix := range l {
			if ix.Size >= 1<<20 {
				parts = append(parts, ix.Name+" "+mb(ix.Size))
			}
		}
	}
	return strings.Join(parts, ", ")
}

// Overall is the worker's p99 over all the cycles of a run, per phase and
// while GC ran at all: more samples than one cycle's, so that a single stall
// (a checkpoint's, say) weighs less.
type Overall struct {
	Ops          [phases]int
	P99          [phases]time.Duration
	OpsGC        int
	P99GC        time.Duration
	DeltaP99     float64
	WorstCycleN  int
	WorstDelta   float64
	CyclesOver20 int
}

// Overall merges the cycles' latencies.
func (r Result) Overall() Overall {
	var o Overall
	var lat [phases][]time.Duration
	for i, c := range r.Cycles {
		for ph := range phases {
			lat[ph] = append(lat[ph], c.lat[ph]...)
		}
		if d := c.DeltaP99(); i == 0 || d > o.WorstDelta {
			o.WorstCycleN, o.WorstDelta = c.N, d
		}
		if c.DeltaP99() > 20 {
			o.CyclesOver20++
		}
	}
	for ph := range phases {
		slices.Sort(lat[ph])
		o.Ops[ph], o.P99[ph] = len(lat[ph]), quantile(lat[ph], 0.99)
	}
	gc := slices.Concat(lat[phaseDelete], lat[phaseVacuum])
	slices.Sort(gc)
	o.OpsGC, o.P99GC = len(gc), quantile(gc, 0.99)
	if o.P99[phaseQuiet] > 0 {
		o.DeltaP99 = 100 * (float64(o.P99GC) - float64(o.P99[phaseQuiet])) / float64(o.P99[phaseQuiet])
	}
	return o
}

func printSummary(out io.Writer, r Result) {
	if len(r.Cycles) == 0 {
		return
	}
	all := r.Overall()
	fmt.Fprintf(out, "\nall cycles: worker p99 %s without GC (%d ops), %s while GC ran (%d ops: %s deleting, %s vacuuming): %+.0f%%; cycles over +20%%: %d of %d (worst: cycle %d, %+.0f%%)\n",
		ms(all.P99[phaseQuiet]), all.Ops[phaseQuiet], ms(all.P99GC), all.OpsGC,
		msOrNone(all.P99[phaseDelete], all.Ops[phaseDelete]), msOrNone(all.P99[phaseVacuum], all.Ops[phaseVacuum]),
		all.DeltaP99, all.CyclesOver20, len(r.Cycles), all.WorstCycleN, all.WorstDelta)
	last := r.Cycles[len(r.Cycles)-1]
	fmt.Fprintln(out)
	fmt.Fprintf(out, "start: %s\n", r.Start)
	fmt.Fprintf(out, "end:   %s\n", last.Sizes)
	var errs, missed int
	var first error
	for _, c := range r.Cycles {
		for _, e := range c.Errors {
			errs += e
		}
		missed += c.Missed
		if first == nil {
			first = c.FirstError
		}
	}
	fmt.Fprintf(out, "rows at the end: %d keys, %d published outbox messages (loaded %d and %d)\n", r.EndKeys, r.EndOutbox, r.Load.Keys, r.Load.Outbox)
	fmt.Fprintf(out, "worker errors %d, operations missed by the pacer %d\n", errs, missed)
	if first != nil {
		fmt.Fprintf(out, "first worker error: %v\n", first)
	}
}
