package demo

import (
	"cmp"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"time"

	"github.com/idemq/idemq/consumer"
)

// Defaults used where Options leaves a field zero.
const (
	DefaultPostgresURL  = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	DefaultAMQPURL      = "amqp://guest:guest@127.0.0.1:5672/"
	DefaultSchema       = "idemq_demo"
	DefaultQueue        = "idemq.demo.payments"
	DefaultPayments     = 3000
	DefaultHTTPPayments = 300
	DefaultWorkers      = 3
	DefaultConcurrency  = 8
	DefaultKillAt       = 0.4
	DefaultTimeout      = 3 * time.Minute
	DefaultConnectWait  = 15 * time.Second
)

// Environment variables read by Run.
const (
	// WorkerEnv holds a worker's configuration; when set, Run is a worker.
	WorkerEnv = "IDEMQ_DEMO_WORKER"
	// JaegerURLEnv is the Jaeger UI base URL used for trace links.
	JaegerURLEnv = "IDEMQ_JAEGER_URL"
)

// The scenario's fixed settings: short, so that a run stays under two minutes.
const (
	// consumerName scopes the keys: one handler, "payments".
	consumerName = "payments"
	// lease is short so that a killed worker's keys are taken over fast.
	lease           = 3 * time.Second
	retryInitial    = 200 * time.Millisecond
	retryMultiplier = 2.0
	maxAttempts     = 4
	handlerTimeout  = 10 * time.Second
	shutdownTimeout = 10 * time.Second
)

// Options configures a demo run. The zero value runs the default scenario
// against the local services.
type Options struct {
	// PostgresURL and AMQPURL locate the services; empty means
	// IDEMQ_POSTGRES_URL / IDEMQ_AMQP_URL, else the local defaults.
	PostgresURL string
	AMQPURL     string
	// Schema is the Postgres schema the demo DROPS and recreates at start.
	// It must contain "demo" (a guard against resetting real keys).
	// Default "idemq_demo".
	Schema string
	// Queue is the work queue the demo deletes and redeclares at start,
	// with its retry tiers and DLQ. It must contain "demo". Default
	// "idemq.demo.payments".
	Queue string
	// Payments is the number of unique payments. Duplicates, bursts, key
	// reuse, poison and bad keys come on top. Default 3000.
	Payments int
	// HTTPPayments is the number of unique payments of the HTTP part, sent
	// through idemq gateway by clients that time out and retry. Default
	// 300; negative skips the HTTP part.
	HTTPPayments int
	// Workers is the number of worker processes. Default 3.
	Workers int
	// Concurrency is the number of handlers in each worker. Default 8.
	Concurrency int
	// KillAt is the fraction of messages settled when one worker is killed
	// with SIGKILL and replaced. Default 0.4; negative means no kill.
	KillAt float64
	// JaegerURL is the Jaeger UI base URL for the trace link of a suppressed
	// duplicate; empty means IDEMQ_JAEGER_URL.
	JaegerURL string
	// Seed makes the scenario reproducible; 0 picks a random seed (printed).
	Seed int64
	// Timeout bounds the wait for every message to settle. Default 3m.
	Timeout time.Duration
	// ConnectWait is how long Run waits for Postgres and RabbitMQ to answer
	// before it gives up. Default 15s.
	ConnectWait time.Duration
	// LogDir receives the workers' logs (worker-N.log); empty means a new
	// temporary directory, kept after the run.
	LogDir string
	// UIListen, when set, leaves `idemq ui` running on the demo's data at
	// the end, on this loopback address, with one worker, until ctx ends.
	UIListen string
}

func (o Options) withDefaults() Options {
	o.PostgresURL = cmp.Or(o.PostgresURL, os.Getenv("IDEMQ_POSTGRES_URL"), DefaultPostgresURL)
	o.AMQPURL = cmp.Or(o.AMQPURL, os.Getenv("IDEMQ_AMQP_URL"), DefaultAMQPURL)
	o.Schema = cmp.Or(o.Schema, DefaultSchema)
	o.Queue = cmp.Or(o.Queue, DefaultQueue)
	o.Payments = cmp.Or(o.Payments, DefaultPayments)
	o.HTTPPayments = cmp.Or(o.HTTPPayments, DefaultHTTPPayments)
	o.Workers = cmp.Or(o.Workers, DefaultWorkers)
	o.Concurrency = cmp.Or(o.Concurrency, DefaultConcurrency)
	o.KillAt = cmp.Or(o.KillAt, DefaultKillAt)
	o.JaegerURL = strings.TrimRight(cmp.Or(o.JaegerURL, os.Getenv(JaegerURLEnv)), "/")
	if o.Seed == 0 {
		o.Seed = rand.Int64N(1<<31-1) + 1
	}
	o.Timeout = cmp.Or(o.Timeout, DefaultTimeout)
	o.ConnectWait = cmp.Or(o.ConnectWait, DefaultConnectWait)
	return o
}

func (o Options) validate() error {
	var errs []error
	if !strings.Contains(o.Schema, "demo") {
		errs = append(errs, fmt.Errorf("schema %q: the demo drops and recreates its schema, so its name must contain \"demo\"", o.Schema))
	}
	if !strings.Contains(o.Queue, "demo") {
		errs = append(errs, fmt.Errorf("queue %q: the demo deletes and redeclares its queues, so the name must contain \"demo\"", o.Queue))
	}
	if o.Payments < 10 {
		errs = append(errs, fmt.Errorf("payments %d: want at least 10", o.Payments))
	}
	if o.Workers < 1 || o.Concurrency < 1 {
		errs = append(errs, fmt.Errorf("workers %d and concurrency %d must be positive", o.Workers, o.Concurrency))
	}
	if o.KillAt >= 1 {
		errs = append(errs, fmt.Errorf("kill-at %g: want a fraction below 1 (negative: no kill)", o.KillAt))
	}
	return errors.Join(errs...)
}

// consumerConfig is the consumer configuration shared by the parent (which
// declares the topology) and the workers.
func consumerConfig(amqpURL, queue string) *consumer.Config {
	return &consumer.Config{
		URL:             amqpURL,
		Queue:           queue,
		Name:            consumerName,
		Lease:           lease,
		RetryInitial:    retryInitial,
		RetryMultiplier: retryMultiplier,
		MaxAttempts:     maxAttempts,
		HandlerTimeout:  handlerTimeout,
		ShutdownTimeout: shutdownTimeout,
		ConnectionName:  "idemq-demo-" + queue,
	}
}
