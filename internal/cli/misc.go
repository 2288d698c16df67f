package cli

import (
	"errors"
	"fmt"
	"runtime"
	"runtime/debug"

	"github.com/spf13/cobra"
)

func (a *app) demoCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "demo",
		Short: "Run the payments scenario end to end",
		Long: `Run the main job end to end: a payments scenario with thousands of messages,
duplicates (including bursts of 20 concurrent copies of one key), key reuse,
poison messages, injected infrastructure failures and a worker killed mid-run,
ending with a report (see 'make demo').`,
		Example: `  idemq demo`,
		Args:    noArgs,
		RunE: run(func(*cobra.Command, []string) error {
			return errors.New("the demo is not built yet")
		}),
	}
}

func (a *app) benchCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "bench",
		Short: "Run the benchmark of docs/benchmarks.md",
		Long: `Run the benchmark described in docs/benchmarks.md. Until it is built into the
binary, this prints how to run the benchmarks with go test.`,
		Example: `  idemq bench`,
		Args:    noArgs,
		RunE: run(func(*cobra.Command, []string) error {
			fmt.Fprintln(a.stdout, `The benchmark is not built into this binary yet.
See docs/benchmarks.md, and run the Go benchmarks against local services:
  go test -run '^$' -bench . -benchmem ./dedup/ ./consumer/ ./outbox/`)
			return nil
		}),
	}
}

func (a *app) versionCommand() *cobra.Command {
	return &cobra.Command{
		Use:     "version",
		Short:   "Print the version of idemq",
		Example: `  idemq version`,
		Args:    noArgs,
		RunE: run(func(*cobra.Command, []string) error {
			rev := ""
			if bi, ok := debug.ReadBuildInfo(); ok {
				for _, s := range bi.Settings {
					if s.Key == "vcs.revision" && len(s.Value) >= 12 {
						rev = " " + s.Value[:12]
					}
				}
			}
			fmt.Fprintf(a.stdout, "idemq %s%s (%s %s/%s)\n", Version, rev, runtime.Version(), runtime.GOOS, runtime.GOARCH)
			return nil
		}),
	}
}
