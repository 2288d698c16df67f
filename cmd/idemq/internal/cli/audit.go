package cli

import (
	"encoding/json"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/idemq/idemq/cmd/idemq/internal/audit"
)

// endAudit records the end of entry: count moved, err nil for "ok". A
// failure to record it is a warning: the action is done.
func (a *app) endAudit(rec *audit.Recorder, entry int64, count int, err error, keyDigests []string) {
	if err := rec.Finish(entry, count, err, keyDigests); err != nil {
		a.log.Warn("audit: the action is done, but its end is not recorded", "entry", entry, "err", err)
	}
}

func (a *app) auditCommand() *cobra.Command {
	var (
		action string
		limit  int
		since  time.Duration
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "audit [--action A] [--since D] [--limit 50]",
		Short: "Show what operators did: replays, unparks and skips",
		Long: `Show the audit record of the schema, the newest first: every replay of dead
letters (` + audit.ActionReplay + `), unpark of outbox rows (` + audit.ActionUnpark + `) and skip of an
ordering key (` + audit.ActionSkip + `), from the UI (under the name of the operator's
token) or the CLI (under the OS user, or order skip's --by): when, who, via
what, on what, how many, and the result. An action is recorded when it starts
and completed when it ends: "running" is one still running, or whose process
ended before it could say.`,
		Example: `  idemq audit
  idemq audit --action dlq.replay --since 24h --json`,
		Args: noArgs,
		RunE: run(func(cmd *cobra.Command, _ []string) error {
			switch action {
			case "", audit.ActionReplay, audit.ActionUnpark, audit.ActionSkip:
			default:
				return usagef("--action %q: want %s, %s or %s", action, audit.ActionReplay, audit.ActionUnpark, audit.ActionSkip)
			}
			if limit <= 0 || since < 0 {
				return usagef("--limit must be positive and --since not negative")
			}
			ctx := cmd.Context()
			pool, err := a.openStorePool(ctx, 2)
			if err != nil {
				return err
			}
			defer pool.Close()
			f := audit.Filter{Action: action, Limit: limit}
			if since > 0 {
				f.Since = time.Now().Add(-since)
			}
			entries, err := audit.New(pool, a.schema).List(ctx, f)
			if err != nil {
				return err
			}
			if asJSON {
				enc := json.NewEncoder(a.stdout)
				enc.SetIndent("", "  ")
				if entries == nil {
					entries = []audit.Entry{}
				}
				return enc.Encode(entries)
			}
			w := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "AT\tWHO\tVIA\tACTION\tON\tWHAT\tCOUNT\tRESULT")
			for _, e := range entries {
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\n", e.At.UTC().Format(time.RFC3339), oneLine(e.Actor, 40), e.Via,
					e.Action.Action, oneLine(e.Target, 60), oneLine(e.What, 80), e.Count, oneLine(e.Result, 80))
			}
			return w.Flush()
		}),
	}
	f := cmd.Flags()
	f.StringVar(&action, "action", "", "only this action: "+audit.ActionReplay+", "+audit.ActionUnpark+" or "+audit.ActionSkip)
	f.DurationVar(&since, "since", 0, "only the entries of the last D (0: all)")
	f.IntVar(&limit, "limit", 50, "most entries shown")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}
