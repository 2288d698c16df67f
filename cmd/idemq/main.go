// Command idemq is the idemq binary: schema migrations, topology, the
// forwarding stage, the outbox relay, retention, key inspection and
// dead-letter tools. See docs/cli.md, or run `idemq --help`.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/idemq/idemq/cmd/idemq/internal/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	go func() {
		// After the first signal, restore the default behaviour: a second
		// one kills the process at once.
		<-ctx.Done()
		stop()
	}()
	code := cli.Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
