package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/idemq/idemq/cmd/idemq/internal/audit"
	"github.com/idemq/idemq/cmd/idemq/internal/dlq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
)

// doomedReasons are the reasons whose letters cannot succeed unchanged.
func doomedReasons() []string {
	var out []string
	for _, r := range consumer.Reasons() {
		if dlq.Doomed(r) != "" {
			out = append(out, r)
		}
	}
	return out
}

func (a *app) dlqCommand() *cobra.Command {
	return group("dlq", "List and replay the dead letters of a work queue", `Dead letters of work queue Q are in Q.dlq. Those dead-lettered by idemq carry
x-idemq-reason (`+consumer.ReasonKeyRequired+`, `+consumer.ReasonKeyInvalid+`,
`+consumer.ReasonKeyReuse+`, `+consumer.ReasonPermanentError+`, `+consumer.ReasonMaxAttemptsExceeded+`,
`+consumer.ReasonHeadersTooLarge+`); those the broker dead-lettered itself carry
x-death (`+consumer.ReasonDeliveryLimit+` when a message kept crashing its workers;
`+consumer.ReasonExpired+`, `+consumer.ReasonMaxLen+`, `+consumer.ReasonRejected+`).`, a.dlqListCommand(), a.dlqReplayCommand())
}

func (a *app) dlqListCommand() *cobra.Command {
	var (
		queue, consumerName string
		keyHeader           string
		tenantHeader        string
		keyFrom             string
		limit               int
		asJSON, showKeys    bool
	)
	cmd := &cobra.Command{
		Use:   "list --queue Q",
		Short: "Show the dead letters of Q.dlq without removing them",
		Long: `Show the dead letters of Q.dlq: the hash of the key (that of the logs of
--consumer and of 'idemq keys inspect'), reason (x-idemq-reason, or the
broker's x-death reason such as delivery_limit), attempts, first seen, the
original exchange and routing key, and the error text; then a count by reason.
The raw key (message_id, which is the key when it is set) is shown only with
--show-keys.

Nothing is removed: the messages are read with basic.get and never acked, and
all go back to the queue when the command's channel closes. While they are
held, other consumers of Q.dlq do not see them.`,
		Example: `  idemq dlq list --queue payments --consumer charge
  idemq dlq list --queue payments --consumer charge --limit 0 --json
  idemq dlq list --queue payments --show-keys`,
		Args: noArgs,
		RunE: run(func(cmd *cobra.Command, _ []string) error {
			if err := nonEmpty(cmd.Flags(), "queue"); err != nil {
				return err
			}
			if limit < 0 {
				return usagef("--limit %d must not be negative", limit)
			}
			conn, err := a.dialAMQP("idemq-dlq-list")
			if err != nil {
				return err
			}
			defer conn.Close()
			preset, err := consumer.ParseKeyPreset(keyFrom)
			if err != nil {
				return usagef("--key-from: %v", err)
			}
			scope := dlq.KeyScope{Consumer: consumerName, KeyHeader: keyHeader, TenantHeader: tenantHeader, KeyFrom: preset}
			res, err := dlq.List(cmd.Context(), conn, dlq.Name(queue), limit, scope)
			if err != nil {
				return hintWorkQueue(err, queue)
			}
			if !showKeys {
				// A message's message_id is its key (the key is read from
				// it first): raw keys stay out of the output unless asked.
				for i := range res.Letters {
					res.Letters[i].MessageID = ""
				}
			}
			if asJSON {
				enc := json.NewEncoder(a.stdout)
				enc.SetIndent("", "  ")
				return enc.Encode(res)
			}
			printLetters(a.stdout, res, showKeys)
			return nil
		}),
	}
	f := cmd.Flags()
	f.StringVar(&queue, "queue", "", "the work queue Q whose Q.dlq is listed (required)")
	f.StringVar(&consumerName, "consumer", "", "the consumer whose scope the keys are in: KEY_HASH is then the key_hash of its logs")
	f.StringVar(&keyHeader, "key-header", consumer.DefaultKeyHeader, "the header a key is read from when a letter has no message_id")
	f.StringVar(&tenantHeader, "tenant-header", consumer.DefaultTenantHeader, "the header a tenant is read from (idemq's own copies carry theirs)")
	f.StringVar(&keyFrom, "key-from", string(consumer.KeyFromMessageID), "the consumer's --key-from: where a letter's key is read from (message-id, masstransit, nservicebus, wolverine, cloudevents)")
	f.BoolVar(&showKeys, "show-keys", false, "show raw keys (message_id) besides their hashes")
	f.IntVar(&limit, "limit", 100, "most dead letters shown (0: all)")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	requireFlags(cmd, "queue")
	return cmd
}

// hintWorkQueue adds a hint to a missing queue's error when --queue looks
// like the name of a DLQ: --queue takes the work queue Q, whose DLQ is Q.dlq.
func hintWorkQueue(err error, queue string) error {
	if work, ok := strings.CutSuffix(queue, ".dlq"); ok && work != "" && errors.Is(err, dlq.ErrNoQueue) {
		return fmt.Errorf("%w (--queue takes the work queue, whose dead letters are in Q.dlq: --queue %s reads %s)", err, work, queue)
	}
	return err
}

// printLetters prints the letters as a table, the raw key (MESSAGE_ID)
// only with showKeys, then the count by reason.
func printLetters(out io.Writer, res dlq.ListResult, showKeys bool) {
	if len(res.Letters) > 0 {
		w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
		if showKeys {
			fmt.Fprint(w, "MESSAGE_ID\t")
		}
		fmt.Fprintln(w, "KEY_HASH\tREASON\tATTEMPTS\tFIRST_SEEN\tORIGINAL_EXCHANGE\tORIGINAL_ROUTING_KEY\tERROR")
		for _, l := range res.Letters {
			attempts := "-"
			if l.Attempts > 0 {
				attempts = fmt.Sprint(l.Attempts)
			} else if l.DeathCount > 0 {
				attempts = fmt.Sprintf("%d (x-death)", l.DeathCount)
			}
			exchange := l.OriginalExchange
			if exchange == "" && l.OriginalRoutingKey != "" {
				exchange = "(default)"
			}
			if showKeys {
				fmt.Fprintf(w, "%s\t", dash(oneLine(l.MessageID, 64)))
			}
			fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n",
				dash(l.KeyHash), l.Reason, attempts, dash(l.FirstSeen),
				dash(exchange), dash(l.OriginalRoutingKey), dash(oneLine(l.Error, 80)))
		}
		_ = w.Flush()
	}
	fmt.Fprintf(out, "%s: %d dead letters", res.Queue, res.InQueue)
	if len(res.Letters) < res.InQueue {
		fmt.Fprintf(out, ", %d shown", len(res.Letters))
	}
	fmt.Fprintln(out)
	reasons := make([]string, 0, len(res.ByReason))
	for r := range res.ByReason {
		reasons = append(reasons, r)
	}
	slices.Sort(reasons)
	for _, r := range reasons {
		fmt.Fprintf(out, "  %s: %d\n", r, res.ByReason[r])
	}
}

// oneLine keeps a table cell on one line and bounded.
func oneLine(s string, n int) string {
	s = strings.Map(func(r rune) rune {
		if r < ' ' || r == 0x7f {
			return ' '
		}
		return r
	}, s)
	if r := []rune(s); len(r) > n {
		return string(r[:n-1]) + "…"
	}
	return s
}

func (a *app) dlqReplayCommand() *cobra.Command {
	var (
		queue, reason          string
		limit                  int
		timeout, retention     time.Duration
		dropUserID, keepUserID bool
		allowDoomed, older     bool
		keyFrom                string
	)
	cmd := &cobra.Command{
		Use:   "replay --queue Q [--reason R]",
		Short: "Move dead letters of Q.dlq back to Q",
		Long: `Move the dead letters of Q.dlq (those with reason --reason, or all) back to the
work queue Q through the default exchange. Each copy keeps its body,
properties, message_id and headers, with x-idemq-reason, x-idemq-error and
x-idemq-attempts removed. idemq's signed headers are kept as they are, so the
consumer still trusts them (tenant, original exchange and routing key, first
seen); idemq's own dead letters carry x-idemq-attempt 1, a full retry budget.
A dead letter is acked
only after the broker confirmed its copy in Q; those that do not match the
reason stay in Q.dlq.

A dead letter the broker made itself (delivery_limit, expired, maxlen,
rejected) keeps its publisher's user_id, which RabbitMQ lets the replaying
connection publish only if it is that connection's user. Such a letter stays
in Q.dlq (exit 1, naming it) unless --drop-user-id replays it without its
user_id (right when the consumer does not take the tenant from user_id:
with TenantFromUserID its key would be claimed in another tenant), or
--keep-user-id keeps it (a replaying user with the impersonator tag).

Letters whose reason cannot succeed unchanged (` + strings.Join(doomedReasons(), ", ") + `)
come straight back to Q.dlq: they stay there, counted, unless --allow-doomed
(--reason naming one of them is refused without it). A letter first seen
longer ago than --key-retention (the store's retention, idemq gc --retention)
may have lost its key: if another copy of it completed once, a replay would
run it again. Such letters stay in Q.dlq (exit 1, counted) unless
--older-than-retention; a letter that carries no time (no x-idemq-first-seen,
timestamp or x-death time) counts as one of them.

SIGINT or SIGTERM stops the replay after the message in hand: nothing is lost;
at worst, if the process dies between a confirm and its ack, a message is both
in Q and in Q.dlq (same message_id and key: the consumer recognises it).
Shows a progress bar when stderr is a terminal; prints "replayed N, skipped M"
(and how many letters were replayed without their user_id, or left for it).
Exits 1 when interrupted or when the broker refuses a copy.`,
		Example: `  idemq dlq replay --queue payments --reason max_attempts_exceeded
  idemq dlq replay --queue payments --reason delivery_limit --limit 100
  idemq dlq replay --queue payments --reason delivery_limit --drop-user-id`,
		Args: noArgs,
		RunE: run(func(cmd *cobra.Command, _ []string) error {
			if err := nonEmpty(cmd.Flags(), "queue"); err != nil {
				return err
			}
			if limit < 0 {
				return usagef("--limit %d must not be negative", limit)
			}
			if timeout <= 0 {
				return usagef("--confirm-timeout %s must be positive", timeout)
			}
			if dropUserID && keepUserID {
				return usagef("--drop-user-id and --keep-user-id exclude each other")
			}
			if reason != "" && !slices.Contains(consumer.Reasons(), reason) {
				return usagef("--reason %q is not a dead-letter reason; want one of %s", reason, strings.Join(consumer.Reasons(), ", "))
			}
			if why := dlq.Doomed(reason); why != "" && !allowDoomed {
				return usagef("--reason %s: these letters cannot succeed unchanged (%s); --allow-doomed replays them anyway", reason, why)
			}
			if retention <= 0 {
				return usagef("--key-retention %s must be positive", retention)
			}
			preset, err := consumer.ParseKeyPreset(keyFrom)
			if err != nil {
				return usagef("--key-from: %v", err)
			}
			// Recorded before it starts: a replay that cannot be recorded does not run.
			ctx := cmd.Context()
			pool, err := a.openStorePool(ctx, 2)
			if err != nil {
				return err
			}
			defer pool.Close()
			conn, err := a.dialAMQP("idemq-dlq-replay")
			if err != nil {
				return err
			}
			defer conn.Close()
			what := "every dead letter"
			if reason != "" {
				what = "the dead letters with reason " + reason
			}
			if limit > 0 {
				what += fmt.Sprintf(", at most %d", limit)
			}
			rec := audit.New(pool, a.schema)
			entry, err := rec.Begin(ctx, audit.Action{Actor: audit.OSUser(), Via: audit.ViaCLI, Action: audit.ActionReplay, Target: queue, What: what})
			if err != nil {
				return err
			}
			var digests []string
			opts := dlq.ReplayOptions{
				Replayed: func(d *amqp.Delivery) {
					if key, _, _ := (dlq.KeyScope{KeyFrom: preset}).OfDelivery(d); key != "" {
						digests = append(digests, audit.KeyDigest(key))
					}
				},
				Queue: dlq.Name(queue), Target: queue, Reason: reason, Limit: limit, ConfirmTimeout: timeout, Logger: a.log,
				Doomed: allowDoomed, Retention: retention, OlderThanRetention: older,
			}
			switch {
			case dropUserID:
				opts.UserID = dlq.UserIDDrop
			case keepUserID:
				opts.UserID = dlq.UserIDKeep
			}
			var bar *progressbar.ProgressBar
			if f, ok := a.stderr.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
				opts.Start = func(total int) {
					if limit > 0 && reason == "" {
						total = min(total, limit)
					}
					bar = progressbar.NewOptions(total,
						progressbar.OptionSetWriter(a.stderr),
						progressbar.OptionSetDescription("replaying "+opts.Queue),
						progressbar.OptionShowCount(),
						progressbar.OptionClearOnFinish(),
						progressbar.OptionThrottle(100*time.Millisecond),
					)
				}
				opts.Progress = func(res dlq.ReplayResult) {
					bar.Describe(fmt.Sprintf("replaying %s (%d replayed)", opts.Queue, res.Replayed))
					_ = bar.Set(res.Read)
				}
			}
			res, err := dlq.Replay(ctx, conn, opts)
			if bar != nil {
				_ = bar.Finish()
			}
			if err == nil && res.Interrupted {
				a.endAudit(rec, entry, res.Replayed, audit.ErrInterrupted, digests)
			} else {
				a.endAudit(rec, entry, res.Replayed, err, digests)
			}
			if err != nil && res.Read == 0 {
				// Nothing was read (a queue that does not exist, a channel
				// refused): the error alone, no count that reads as a run.
				return hintWorkQueue(err, queue)
			}
			fmt.Fprintf(a.stdout, "replayed %d, skipped %d", res.Replayed, res.Skipped)
			if res.UserIDDropped > 0 {
				fmt.Fprintf(a.stdout, ", %d of them without their user_id", res.UserIDDropped)
			}
			if res.UserIDRefused > 0 {
				fmt.Fprintf(a.stdout, ", %d left for their user_id", res.UserIDRefused)
			}
			if res.Doomed > 0 {
				fmt.Fprintf(a.stdout, ", %d left: their reason cannot succeed unchanged (--allow-doomed)", res.Doomed)
			}
			if res.Old > 0 {
				fmt.Fprintf(a.stdout, ", %d left: older than the key retention (%s)", res.Old, retention)
			}
			fmt.Fprintln(a.stdout)
			if errors.Is(err, dlq.ErrOlderThanRetention) {
				err = fmt.Errorf("%w; --older-than-retention replays them (each runs again if its key is gone)", err)
			}
			if errors.Is(err, dlq.ErrForeignUserID) {
				return fmt.Errorf("%w; --drop-user-id replays them without it, --keep-user-id with it (a replaying user with the impersonator tag)", err)
			}
			if err != nil {
				return hintWorkQueue(err, queue)
			}
			if res.Interrupted {
				return fmt.Errorf("replay interrupted after %d messages; the rest is still in %s", res.Read, opts.Queue)
			}
			return nil
		}),
	}
	f := cmd.Flags()
	f.StringVar(&queue, "queue", "", "the work queue Q: reads Q.dlq, replays to Q (required)")
	f.StringVar(&reason, "reason", "", "replay only dead letters with this reason (x-idemq-reason, or the x-death reason): "+strings.Join(consumer.Reasons(), ", "))
	f.IntVar(&limit, "limit", 0, "most dead letters replayed (0: all)")
	f.DurationVar(&timeout, "confirm-timeout", dlq.DefaultConfirmTimeout, "how long to wait for the broker to confirm one copy")
	f.BoolVar(&dropUserID, "drop-user-id", false, "replay a letter whose user_id the replaying user may not publish without it (not when the consumer takes the tenant from user_id)")
	f.BoolVar(&keepUserID, "keep-user-id", false, "replay every letter with its user_id (the replaying user has RabbitMQ's impersonator tag)")
	f.BoolVar(&allowDoomed, "allow-doomed", false, "replay letters whose reason cannot succeed unchanged (they come straight back unless their cause changed)")
	f.StringVar(&keyFrom, "key-from", string(consumer.KeyFromMessageID), "the consumer's --key-from, under which the audit records the replayed keys (message-id, masstransit, nservicebus, wolverine, cloudevents)")
	f.DurationVar(&retention, "key-retention", dedup.DefaultRetention, "the key store's retention (idemq gc --retention): older letters may have lost their key")
	f.BoolVar(&older, "older-than-retention", false, "replay letters older than --key-retention too (each runs again if its key is gone)")
	requireFlags(cmd, "queue")
	return cmd
}
