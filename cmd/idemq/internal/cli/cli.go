// Package cli is the idemq command line: the cobra commands that cmd/idemq
// wires to the process (arguments, standard streams, signals).
//
// # Exit codes
//
// Main returns ExitOK (0) on success, ExitUsage (2) for bad usage (an unknown
// command or flag, a missing or malformed argument, a malformed environment
// variable) and ExitFailure (1) for everything that went wrong at run time
// (a service out of reach, a key not found, a refused topology).
//
// # Configuration
//
// The global flags --postgres-url, --amqp-url, --schema, --log-level,
// --log-format and --connect-timeout fall back to the environment variables
// IDEMQ_POSTGRES_URL, IDEMQ_AMQP_URL, IDEMQ_SCHEMA, IDEMQ_LOG_LEVEL,
// IDEMQ_LOG_FORMAT and IDEMQ_CONNECT_TIMEOUT; a flag given on the command line
// wins over its variable. Connection URLs never appear in logs or errors with
// their credentials.
package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/idemq/idemq/cmd/idemq/internal/telemetry"
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/redact"
)

// Exit codes of Main.
const (
	ExitOK      = 0
	ExitFailure = 1
	ExitUsage   = 2
)

// Defaults of the global flags.
const (
	DefaultPostgresURL    = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	DefaultAMQPURL        = "amqp://guest:guest@127.0.0.1:5672/"
	DefaultConnectTimeout = 5 * time.Second
)

// Version is the idemq version, set at build time with
// -ldflags "-X github.com/idemq/idemq/cmd/idemq/internal/cli.Version=v1.2.3".
var Version = "dev"

// Main runs the idemq command line with args (without the program name) and
// returns the process exit code. Commands that run until stopped (forward,
// relay) stop when ctx ends; one-shot commands are interrupted by it.
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	a := &app{stdout: stdout, stderr: stderr, getenv: os.Getenv}
	root := a.rootCommand()
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	cmd, err := root.ExecuteContextC(ctx)
	if a.tel != nil {
		// Flush the spans and metrics still buffered, bounded: a collector
		// that is down must not hold the exit.
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		if serr := a.tel.Shutdown(sctx); serr != nil {
			a.log.Warn("telemetry shutdown", "err", redact.Error(serr))
		}
		cancel()
	}
	return a.exitCode(ctx, cmd, err)
}

// exitCode reports err on stderr and maps it to an exit code.
func (a *app) exitCode(ctx context.Context, cmd *cobra.Command, err error) int {
	if err == nil {
		return ExitOK
	}
	var fail *failure
	if errors.As(err, &fail) {
		msg := redact.Error(fail.err)
		if ctx.Err() != nil && errors.Is(fail.err, context.Canceled) {
			msg = "interrupted"
		}
		fmt.Fprintf(a.stderr, "idemq: %s\n", msg)
		return ExitFailure
	}
	// Everything else comes from cobra's parsing or from usageError: bad usage.
	path := "idemq"
	if cmd != nil {
		path = cmd.CommandPath()
	}
	fmt.Fprintf(a.stderr, "idemq: %s\nRun '%s --help' for usage.\n", redact.Error(err), path)
	return ExitUsage
}

// usageError is a mistake on the command line: exit code 2.
type usageError struct{ err error }

func (e *usageError) Error() string { return e.err.Error() }
func (e *usageError) Unwrap() error { return e.err }

func usagef(format string, args ...any) error {
	return &usageError{fmt.Errorf(format, args...)}
}

// failure is a run-time failure: exit code 1.
type failure struct{ err error }

func (e *failure) Error() string { return e.err.Error() }
func (e *failure) Unwrap() error { return e.err }

// run adapts a command's body to cobra: errors it returns are run-time
// failures (exit 1) unless they are usage errors (exit 2).
func run(fn func(cmd *cobra.Command, args []string) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		err := fn(cmd, args)
		var ue *usageError
		if err == nil || errors.As(err, &ue) {
			return err
		}
		return &failure{err}
	}
}

// app holds what every command shares: the streams and the global options.
type app struct {
	stdout, stderr io.Writer
	getenv         func(string) string

	postgresURL string
	// postgresDirectURL reaches the database of postgresURL without a
	// pooler, for the work that needs a session; "" when it needs none.
	postgresDirectURL string
	amqpURL           string
	schema            string
	logLevel          string
	logFormat         string
	connectTimeout    time.Duration

	log *slog.Logger
	tel *telemetry.Telemetry
}

// envFlags maps global flags to their environment fallbacks.
var envFlags = []struct{ flag, env string }{
	{"postgres-url", "IDEMQ_POSTGRES_URL"},
	{"postgres-direct-url", "IDEMQ_POSTGRES_DIRECT_URL"},
	{"amqp-url", "IDEMQ_AMQP_URL"},
	{"schema", "IDEMQ_SCHEMA"},
	{"log-level", "IDEMQ_LOG_LEVEL"},
	{"log-format", "IDEMQ_LOG_FORMAT"},
	{"connect-timeout", "IDEMQ_CONNECT_TIMEOUT"},
}

func (a *app) rootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:   "idemq",
		Short: "Make RabbitMQ at-least-once delivery safe to act on",
		Long: `idemq claims each message's idempotency key in Postgres before the message is
handled, commits the handler's effects with the key's completion, forwards side
effects through a transactional outbox, and sends failures to retry tiers or a
dead-letter queue.

Global flags fall back to environment variables (a flag given wins):
  --postgres-url     IDEMQ_POSTGRES_URL
  --postgres-direct-url  IDEMQ_POSTGRES_DIRECT_URL
  --amqp-url         IDEMQ_AMQP_URL
  --schema           IDEMQ_SCHEMA
  --log-level        IDEMQ_LOG_LEVEL
  --log-format       IDEMQ_LOG_FORMAT
  --connect-timeout  IDEMQ_CONNECT_TIMEOUT

Exit codes: 0 success, 1 run-time failure, 2 bad usage.`,
		Example: `  idemq migrate
  idemq topology apply --queue payments
  idemq forward --queue payments --consumer charge --to-exchange ledger
  idemq dlq list --queue payments`,
		SilenceErrors:     true,
		SilenceUsage:      true,
		PersistentPreRunE: a.setup,
	}
	root.CompletionOptions.HiddenDefaultCmd = true
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return &usageError{err} })

	f := root.PersistentFlags()
	f.StringVar(&a.postgresURL, "postgres-url", DefaultPostgresURL, "Postgres URL of the key store and the outbox (env IDEMQ_POSTGRES_URL)")
	f.StringVar(&a.postgresDirectURL, "postgres-direct-url", "", "where --postgres-url goes through a transaction pooler (PgBouncer): a URL of the same database without it, for what needs a session — the relay's LISTEN, GC's VACUUM (env IDEMQ_POSTGRES_DIRECT_URL; default --postgres-url)")
	a.amqpURL = DefaultAMQPURL
	f.Var(&urlList{s: &a.amqpURL}, "amqp-url", "RabbitMQ URL, amqp:// or amqps://; several (the nodes of a cluster) separated by commas or with the flag repeated (env IDEMQ_AMQP_URL)")
	f.StringVar(&a.schema, "schema", schema.Default, "Postgres schema of idemq's tables (env IDEMQ_SCHEMA)")
	f.StringVar(&a.logLevel, "log-level", "info", "log level: debug, info, warn or error (env IDEMQ_LOG_LEVEL)")
	f.StringVar(&a.logFormat, "log-format", "text", "log format on stderr: text or json (env IDEMQ_LOG_FORMAT)")
	f.DurationVar(&a.connectTimeout, "connect-timeout", DefaultConnectTimeout, "how long to wait for Postgres and RabbitMQ to answer a connection (env IDEMQ_CONNECT_TIMEOUT)")

	root.AddCommand(
		a.migrateCommand(),
		a.topologyCommand(),
		a.forwardCommand(),
		a.gatewayCommand(),
		a.relayCommand(),
		a.gcCommand(),
		a.keysCommand(),
		a.dlqCommand(),
		a.orderCommand(),
		a.auditCommand(),
		a.uiCommand(),
		a.publishCommand(),
		a.demoCommand(),
		a.benchCommand(),
		a.scaleCommand(),
		a.versionCommand(),
	)
	return root
}

// setup applies the environment fallbacks, checks the global flags and
// builds the logger. It runs before every command.
func (a *app) setup(cmd *cobra.Command, _ []string) error {
	flags := cmd.Root().PersistentFlags()
	for _, ef := range envFlags {
		v := a.getenv(ef.env)
		if v == "" || flags.Changed(ef.flag) {
			continue
		}
		if err := flags.Set(ef.flag, v); err != nil {
			return usagef("environment variable %s: %s", ef.env, redact.Error(err))
		}
	}
	if err := schema.Validate(a.schema); err != nil {
		// "--schema "X": want …"
		return usagef("--%w", err)
	}
	if a.connectTimeout <= 0 {
		return usagef("--connect-timeout %s must be positive", a.connectTimeout)
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(a.logLevel)); err != nil {
		return usagef("--log-level %q: want debug, info, warn or error", a.logLevel)
	}
	opts := &slog.HandlerOptions{Level: level}
	switch strings.ToLower(a.logFormat) {
	case "text":
		a.log = slog.New(slog.NewTextHandler(a.stderr, opts))
	case "json":
		a.log = slog.New(slog.NewJSONHandler(a.stderr, opts))
	default:
		return usagef("--log-format %q: want text or json", a.logFormat)
	}
	slog.SetDefault(a.log)
	return nil
}

// group returns a command that only holds subcommands: alone it prints its
// help; with an unknown subcommand it is a usage error.
func group(use, short, long string, subs ...*cobra.Command) *cobra.Command {
	c := &cobra.Command{
		Use:   use,
		Short: short,
		Long:  long,
		Args:  cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) > 0 {
				return usagef("unknown command %q for %q", args[0], cmd.CommandPath())
			}
			return cmd.Help()
		},
	}
	c.AddCommand(subs...)
	return c
}

// noArgs rejects positional arguments as a usage error.
func noArgs(cmd *cobra.Command, args []string) error {
	if len(args) > 0 {
		return usagef("%s takes no arguments, got %q", strings.TrimPrefix(cmd.CommandPath(), "idemq "), args[0])
	}
	return nil
}

// requireFlags marks flags required (cobra reports a missing one as usage).
func requireFlags(cmd *cobra.Command, names ...string) {
	for _, n := range names {
		if err := cmd.MarkFlagRequired(n); err != nil {
			panic(err) // a programming error: the flag does not exist
		}
	}
}

// nonEmpty checks that the string flags given are not empty.
func nonEmpty(flags *pflag.FlagSet, names ...string) error {
	for _, n := range names {
		if f := flags.Lookup(n); f != nil && f.Value.String() == "" {
			return usagef("--%s must not be empty", n)
		}
	}
	return nil
}

// startTelemetry sets up OpenTelemetry for a long-running command from the
// OTEL_* variables (traces exported over OTLP when an endpoint is set) and
// serves Prometheus metrics on metricsAddr when it is set. Main flushes and
// stops it when the command returns. ready, when not nil, answers /healthz
// (see telemetry.HealthHandler).
func (a *app) startTelemetry(ctx context.Context, metricsAddr string, ready func() error) error {
	return a.startTelemetryOn(ctx, metricsServer{addr: metricsAddr}, ready)
}

// metricsServer is where a command serves its metrics: the address
// (--metrics-addr, "" for none) and the names beyond it and localhost that
// the server answers to (--allow-host).
type metricsServer struct {
	addr       string
	allowHosts []string
}

// startTelemetryOn is startTelemetry with the metrics server's allowed
// host names.
func (a *app) startTelemetryOn(ctx context.Context, m metricsServer, ready func() error) error {
	tel, err := telemetry.Setup(ctx, telemetry.Options{
		ServiceName:    telemetry.DefaultServiceName,
		ServiceVersion: Version,
		MetricsAddr:    m.addr,
		AllowHosts:     m.allowHosts,
		Logger:         a.log,
		Ready:          ready,
	})
	if err != nil {
		return err
	}
	a.tel = tel
	if addr := tel.MetricsAddr(); addr != "" {
		a.log.Info("serving metrics", "addr", addr, "path", "/metrics")
	}
	return nil
}

// urlList is a flag of one URL or several: each use adds to the list (the
// first replaces the default), and a value may itself be a comma-separated
// list. The list is kept as one comma-separated string, the form the
// library's configs take.
type urlList struct {
	s   *string
	set bool
}

func (u *urlList) String() string {
	if u.s == nil {
		return ""
	}
	return *u.s
}

func (u *urlList) Set(v string) error {
	if u.set && *u.s != "" {
		*u.s += "," + v
	} else {
		*u.s = v
	}
	u.set = true
	return nil
}

func (u *urlList) Type() string { return "urls" }
