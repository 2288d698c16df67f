package demo

import (
	"context"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
)

// Report is the outcome of a run, computed at the end from the database (key
// rows, ledger, publication log, worker events) and the queues.
type Report struct {
	Seed  int64
	Queue string
	// Published counts the messages the broker confirmed; PublishedByKind
	// splits them by what the scenario meant them to be.
	Published       int
	PublishedByKind map[string]int
	// DuplicatesPublished counts publications that repeat an earlier one of
	// the same key with the same body (redeliveries and burst copies).
	DuplicatesPublished int

	// UniqueKeys counts the keys whose first publication is a valid payment
	// (a valid key and a well-formed body). Each must end in one of
	// Processed, Rejected, DeadLetteredKeys; LostKeys counts the others.
	UniqueKeys       int
	Processed        int // completed ok: exactly one ledger row
	Rejected         int // completed as a business rejection: no ledger row
	DeadLetteredKeys int // failed on every attempt, a copy in the DLQ: no ledger row
	LostKeys         int // none of the above: the invariant is broken

	// Effects counts ledger rows (card charges). It must equal Processed.
	Effects int
	// DoubledKeys counts keys with more than one ledger row.
	DoubledKeys int
	// StrayEffects counts ledger rows of keys that are not completed ok.
	StrayEffects int
	// UnexpectedCompletions counts completed keys whose first publication
	// was not a valid payment.
	UnexpectedCompletions int

	// From the workers' events (best effort: a killed worker loses its last ones).
	DuplicatesSuppressed int
	Retries              int // infrastructure failures sent through a retry tier
	Deferred             int // copies that found their key leased by another worker
	LeaseLost            int

	// DeadLetters counts the DLQ's messages by x-idemq-reason;
	// ExpectedDeadLetters is what the publications call for (at least).
	DeadLetters         map[string]int
	ExpectedDeadLetters map[string]int

	// InProgress counts keys still held under a valid lease (must be 0);
	// Released counts keys given up after a failure (poison, exhausted
	// attempts), left for retention to collect.
	InProgress int
	Released   int
	// Unsettled counts messages left in the work queue and the retry tiers.
	Unsettled int

	WorkerKills, WorkerRestarts int
	// Kill says which worker was killed, and when.
	Kill    string
	Elapsed time.Duration

	// DuplicateTraceID is the trace of one suppressed duplicate,
	// OriginalTraceID that of the processing it duplicated; TraceLink shows
	// them (a Jaeger link, a trace id, or why there is none).
	DuplicateTraceID, OriginalTraceID string
	// TraceLinkChecked is true when Jaeger's API showed the duplicate's
	// span linking to the original processing's trace.
	TraceLinkChecked bool
	TraceLink        string

	// HTTP is the HTTP part's outcome (nil when it did not run).
	HTTP *HTTPReport

	// Failures lists what broke the invariant; empty means OK.
	Failures []string
}

// OK reports whether the run upheld the invariant.
func (r Report) OK() bool { return len(r.Failures) == 0 }

// report computes the Report from the database and the queues.
func (r *runner) report(ctx context.Context) (Report, error) {
	rep := Report{
		Seed: r.o.Seed, Queue: r.o.Queue, WorkerKills: r.kills, Kill: r.killNote, WorkerRestarts: r.restarts,
		PublishedByKind: map[string]int{}, ExpectedDeadLetters: map[string]int{},
	}
	s := pgx.Identifier{r.o.Schema}.Sanitize()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()

	rows, err := r.pool.Query(ctx, `SELECT kind, count(*) FROM `+s+`.publications GROUP BY kind`)
	if err != nil {
		return rep, err
	}
	for rows.Next() {
		var k string
		var n int
		if err := rows.Scan(&k, &n); err != nil {
			return rep, err
		}
		rep.PublishedByKind[k] = n
		rep.Published += n
	}
	if err := rows.Err(); err != nil {
		return rep, err
	}

	// The first publication of each key decides what the key is.
	const firsts = `WITH f AS (
    SELECT DISTINCT ON (key) key, seq, body, valid FROM %[1]s.publications WHERE key <> '' ORDER BY key, seq
), e AS (SELECT key, body FROM f WHERE valid)`
	var notCompleted []string
	var down int
	err = r.pool.QueryRow(ctx, fmt.Sprintf(firsts+`
SELECT
    (SELECT count(*) FROM e),
    (SELECT count(*) FROM %[1]s.publications p JOIN f ON p.key = f.key AND p.seq > f.seq AND p.body = f.body WHERE f.valid),
    (SELECT count(*) FROM e WHERE convert_from(body, 'UTF8')::jsonb->>'network' = $2),
    (SELECT count(*) FROM e JOIN %[1]s.keys k ON (k.consumer, k.tenant, k.key) = ($1, '', e.key) WHERE k.state = 'completed' AND k.outcome = 'ok'),
    (SELECT count(*) FROM e JOIN %[1]s.keys k ON (k.consumer, k.tenant, k.key) = ($1, '', e.key) WHERE k.state = 'completed' AND k.outcome = 'rejected'),
    (SELECT coalesce(array_agg(e.key ORDER BY e.key), '{}') FROM e LEFT JOIN %[1]s.keys k ON (k.consumer, k.tenant, k.key) = ($1, '', e.key)
        WHERE k.state IS DISTINCT FROM 'completed'),
    (SELECT count(*) FROM %[1]s.keys k WHERE k.state = 'completed' AND NOT EXISTS (SELECT 1 FROM e WHERE e.key = k.key))`, s),
		consumerName, downNetwork,
	).Scan(&rep.UniqueKeys, &rep.DuplicatesPublished, &down, &rep.Processed, &rep.Rejected, &notCompleted, &rep.UnexpectedCompletions)
	if err != nil {
		return rep, fmt.Errorf("key fates: %w", err)
	}

	err = r.pool.QueryRow(ctx, fmt.Sprintf(`SELECT
    (SELECT count(*) FROM %[1]s.charges),
    (SELECT count(*) FROM (SELECT key FROM %[1]s.charges GROUP BY key HAVING count(*) > 1) d),
    (SELECT count(*) FROM %[1]s.charges c WHERE NOT EXISTS (SELECT 1 FROM %[1]s.keys k
        WHERE (k.consumer, k.tenant, k.key) = ($1, '', c.key) AND k.state = 'completed' AND k.outcome = 'ok')),
    (SELECT count(*) FROM %[1]s.keys WHERE state = 'in_progress' AND locked_until > now()),
    (SELECT count(*) FROM %[1]s.keys WHERE state = 'in_progress' AND locked_until <= now())`, s),
		consumerName,
	).Scan(&rep.Effects, &rep.DoubledKeys, &rep.StrayEffects, &rep.InProgress, &rep.Released)
	if err != nil {
		return rep, fmt.Errorf("effects: %w", err)
	}

	rows, err = r.pool.Query(ctx, `SELECT outcome, count(*) FROM `+s+`.events GROUP BY outcome`)
	if err != nil {
		return rep, err
	}
	for rows.Next() {
		var o string
		var n int
		if err := rows.Scan(&o, &n); err != nil {
			return rep, err
		}
		switch consumer.Outcome(o) {
		case consumer.OutcomeDuplicate:
			rep.DuplicatesSuppressed = n
		case consumer.OutcomeRetried:
			rep.Retries = n
		case consumer.OutcomeInProgress:
			rep.Deferred = n
		case consumer.OutcomeLeaseLost:
			rep.LeaseLost = n
		}
	}
	if err := rows.Err(); err != nil {
		return rep, err
	}

	// The queues: nothing left to settle; the DLQ read by reason.
	st, err := r.insp.state()
	if err != nil {
		return rep, err
	}
	rep.Unsettled = st.Ready + st.Retrying
	var dlqIDs map[string][]string
	rep.DeadLetters, dlqIDs, err = r.insp.deadLetters()
	if err != nil {
		return rep, err
	}
	rep.ExpectedDeadLetters = map[string]int{
		consumer.ReasonPermanentError:      rep.PublishedByKind[string(kindPoison)],
		consumer.ReasonKeyReuse:            rep.PublishedByKind[string(kindReuse)],
		consumer.ReasonKeyRequired:         rep.PublishedByKind[string(kindNoKey)],
		consumer.ReasonKeyInvalid:          rep.PublishedByKind[string(kindBadKey)],
		consumer.ReasonMaxAttemptsExceeded: down,
	}
	exhausted := map[string]bool{}
	for _, id := range dlqIDs[consumer.ReasonMaxAttemptsExceeded] {
		exhausted[id] = true
	}
	for _, key := range notCompleted {
		if exhausted[key] {
			rep.DeadLetteredKeys++
		} else {
			rep.LostKeys++
		}
	}

	if err := r.traceLink(ctx, &rep); err != nil {
		return rep, err
	}
	rep.check()
	return rep, nil
}

// traceLink picks one suppressed duplicate (from a burst if possible) and
// links its trace.
func (r *runner) traceLink(ctx context.Context, rep *Report) error {
	s := pgx.Identifier{r.o.Schema}.Sanitize()
	var burstHashes []string
	for _, k := range r.plan.Bursts {
		burstHashes = append(burstHashes, dedup.Scope{Consumer: consumerName, Key: k}.KeyHash())
	}
	rows, err := r.pool.Query(ctx, `SELECT trace_id, original_trace_id FROM `+s+`.events
WHERE outcome = 'duplicate' AND trace_id <> '' AND original_trace_id <> ''
ORDER BY key_hash = ANY($1) DESC, id LIMIT $2`, burstHashes, traceCandidates)
	if err != nil {
		return fmt.Errorf("trace of a duplicate: %w", err)
	}
	candidates, err := pgx.CollectRows(rows, pgx.RowToStructByPos[tracePair])
	if err != nil {
		return fmt.Errorf("trace of a duplicate: %w", err)
	}
	if len(candidates) > 0 {
		rep.DuplicateTraceID, rep.OriginalTraceID = candidates[0].Duplicate, candidates[0].Original
	}
	var jaegerErr error
	if len(candidates) > 0 && r.o.JaegerURL != "" {
		// Some duplicates ran in the worker that was killed, whose spans
		// never left it: show the first that Jaeger holds.
		var found tracePair
		found, jaegerErr = findDuplicateInJaeger(ctx, r.o.JaegerURL, candidates)
		if jaegerErr == nil {
			rep.DuplicateTraceID, rep.OriginalTraceID, rep.TraceLinkChecked = found.Duplicate, found.Original, true
		}
	}
	switch {
	case rep.DuplicateTraceID != "" && r.o.JaegerURL != "":
		indent := "\n" + strings.Repeat(" ", reportIndent)
		rep.TraceLink = fmt.Sprintf("%[1]s/trace/%[2]s%[4]sit links to the original processing: %[1]s/trace/%[3]s",
			r.o.JaegerURL, rep.DuplicateTraceID, rep.OriginalTraceID, indent)
		if jaegerErr != nil {
			rep.TraceLink += indent + "(" + jaegerErr.Error() + ")"
		} else {
			rep.TraceLink += indent + "(both traces found in Jaeger, the link checked)"
		}
		if !jaegerServesUI(ctx, r.o.JaegerURL) {
			rep.TraceLink += indent + "(this Jaeger serves its query API but no UI: its links open a placeholder page;" +
				indent + " idemq demo --ui, or make demo ARGS=--ui, shows both traces in idemq ui)"
		}
	case rep.DuplicateTraceID != "":
		rep.TraceLink = fmt.Sprintf("trace %s, original processing in trace %s (set %s for a Jaeger link)",
			rep.DuplicateTraceID, rep.OriginalTraceID, JaegerURLEnv)
	default:
		rep.TraceLink = "(tracing off: " + jaegerHint + ")"
	}
	return nil
}

// check fills Failures with every broken part of the invariant.
func (r *Report) check() {
	var f []string
	if r.Effects != r.Processed {
		f = append(f, fmt.Sprintf("effects applied %d != unique keys processed %d", r.Effects, r.Processed))
	}
	if r.DoubledKeys > 0 {
		f = append(f, fmt.Sprintf("%d keys charged more than once", r.DoubledKeys))
	}
	if r.StrayEffects > 0 {
		f = append(f, fmt.Sprintf("%d charges without a processed key", r.StrayEffects))
	}
	if r.LostKeys > 0 {
		f = append(f, fmt.Sprintf("%d keys lost (neither completed nor dead-lettered)", r.LostKeys))
	}
	if r.UnexpectedCompletions > 0 {
		f = append(f, fmt.Sprintf("%d keys completed that were never a valid payment", r.UnexpectedCompletions))
	}
	if r.InProgress > 0 {
		f = append(f, fmt.Sprintf("%d keys still in progress", r.InProgress))
	}
	if r.Unsettled > 0 {
		f = append(f, fmt.Sprintf("%d messages left in the work queue and retry tiers", r.Unsettled))
	}
	for _, reason := range slices.Sorted(maps.Keys(r.ExpectedDeadLetters)) {
		if want, got := r.ExpectedDeadLetters[reason], r.DeadLetters[reason]; got < want {
			f = append(f, fmt.Sprintf("%d dead letters %s, want %d", got, reason, want))
		}
	}
	r.Failures = append(r.Failures, f...)
}

// reportIndent is the column where the report's values start.
const reportIndent = 29

// print writes the report.
func (r Report) print(w io.Writer) {
	k := r.PublishedByKind
	line := func(label string, format string, args ...any) {
		fmt.Fprintf(w, "  %-*s %s\n", reportIndent-3, label, fmt.Sprintf(format, args...))
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Report (from the database and the queues)")
	line("published", "%d messages: %d payments, %d burst copies, %d redeliveries, %d key reuses, %d poison, %d without key, %d invalid keys",
		r.Published, k[string(kindPayment)], k[string(kindBurst)], k[string(kindDuplicate)], k[string(kindReuse)],
		k[string(kindPoison)], k[string(kindNoKey)], k[string(kindBadKey)])
	line("unique keys", "%d (first publication a valid payment)", r.UniqueKeys)
	line("  processed", "%d", r.Processed)
	line("  rejected", "%d (insufficient funds: stored, replayed to duplicates)", r.Rejected)
	line("  dead-lettered", "%d (card network down on every attempt)", r.DeadLetteredKeys)
	line("  lost", "%d", r.LostKeys)
	line("effects applied", "%d card charges in the ledger (%d keys charged twice)", r.Effects, r.DoubledKeys)
	line("duplicates suppressed", "%d (%d duplicate copies published; a kill adds redeliveries of messages processed but not acked)",
		r.DuplicatesSuppressed, r.DuplicatesPublished)
	line("retries", "%d infrastructure failures retried through the tiers", r.Retries)
	line("deferred", "%d copies found their key leased by another worker (bursts, the killed worker's keys)", r.Deferred)
	if r.LeaseLost > 0 {
		line("leases lost", "%d", r.LeaseLost)
	}
	total := 0
	for _, n := range r.DeadLetters {
		total += n
	}
	line("dead letters", "%d, kept in %s.dlq (idemq dlq list --queue %s)", total, r.Queue, r.Queue)
	reasons := slices.Sorted(maps.Keys(r.DeadLetters))
	for _, reason := range slices.Sorted(maps.Keys(r.ExpectedDeadLetters)) {
		if _, ok := r.DeadLetters[reason]; !ok {
			reasons = append(reasons, reason)
		}
	}
	for _, reason := range reasons {
		got, want := r.DeadLetters[reason], r.ExpectedDeadLetters[reason]
		switch {
		case got > want:
			line("  "+reason, "%d (at least %d expected; %d more: a copy redelivered after a kill, dead-lettered before its ack, is dead-lettered again)",
				got, want, got-want)
		default:
			line("  "+reason, "%d (at least %d expected)", got, want)
		}
	}
	line("keys in progress", "%d (%d released after a failure, left to retention)", r.InProgress, r.Released)
	line("worker kills", "%d (SIGKILL; the others stopped with SIGTERM)", r.WorkerKills)
	if r.Kill != "" {
		line("", "%s", r.Kill)
	}
	if r.WorkerRestarts > 0 {
		line("worker restarts", "%d", r.WorkerRestarts)
	}
	line("elapsed", "%s", r.Elapsed.Round(100*time.Millisecond))
	line("a duplicate in Jaeger", "%s", r.TraceLink)
	if r.HTTP != nil {
		r.HTTP.print(w)
	}
	fmt.Fprintln(w)
	if r.OK() {
		verdict := "OK: effects applied == unique keys processed, 0 doubled, 0 lost"
		if r.HTTP != nil {
			verdict += fmt.Sprintf("; HTTP: charges == unique operations (%d), 0 doubled", r.HTTP.Operations)
		}
		fmt.Fprintln(w, verdict)
		return
	}
	fmt.Fprintln(w, "FAILED: "+strings.Join(r.Failures, "; "))
}
