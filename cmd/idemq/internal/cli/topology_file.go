package cli

import (
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"gopkg.in/yaml.v3"

	"github.com/idemq/idemq/consumer"
)

// topologyFile is the topology of a deployment, as `topology apply -f` and
// `topology diff -f` read it (docs/topology.md#the-topology-file).
type topologyFile struct {
	// Queues are the work queues, each with its tiers, DLQ and bindings.
	Queues []fileQueue `yaml:"queues"`
	// Exchanges are the exchanges outboxes publish to (forward's
	// --to-exchange, outbox.Message.Exchange).
	Exchanges []fileExchange `yaml:"exchanges"`
}

// fileQueue is one work queue of a topology file. Zero fields take the
// defaults of `topology apply`'s flags.
type fileQueue struct {
	Name          string `yaml:"name"`
	Kind          string `yaml:"kind"` // quorum (default) or classic
	DeliveryLimit int    `yaml:"delivery_limit"`
	// QuorumInitialGroupSize is x-quorum-initial-group-size (0: the
	// broker's default).
	QuorumInitialGroupSize int           `yaml:"quorum_initial_group_size"`
	Retry                  fileRetry     `yaml:"retry"`
	Bindings               []fileBinding `yaml:"bindings"`
	// Partitions splits the queue for ordered consumption (`topology
	// apply --partitions`).
	Partitions int `yaml:"partitions"`
}

type fileRetry struct {
	MaxAttempts int           `yaml:"max_attempts"`
	Initial     time.Duration `yaml:"initial"`
	Multiplier  float64       `yaml:"multiplier"`
	Max         time.Duration `yaml:"max"`
}

type fileBinding struct {
	Exchange  string         `yaml:"exchange"`
	Kind      string         `yaml:"kind"`
	Key       string         `yaml:"key"`
	Arguments map[string]any `yaml:"arguments"`
	Declare   bool           `yaml:"declare"`
}

type fileExchange struct {
	Name string `yaml:"name"`
	Kind string `yaml:"kind"`
}

// deployment is a topology file checked and turned into what is declared.
type deployment struct {
	queues    []consumer.TopologyConfig
	exchanges []fileExchange
}

// loadTopologyFile reads and checks a topology file. Every mistake in it is
// bad usage (exit 2), reported with the file's name and the queue's.
func loadTopologyFile(path string) (deployment, error) {
	f, err := os.Open(path)
	if err != nil {
		return deployment{}, usagef("-f: %w", err)
	}
	defer f.Close()
	var doc topologyFile
	dec := yaml.NewDecoder(f)
	dec.KnownFields(true)
	if err := dec.Decode(&doc); err != nil && !errors.Is(err, io.EOF) {
		return deployment{}, usagef("%s: %w", path, err)
	}
	d, err := doc.deployment()
	if err != nil {
		return deployment{}, usagef("%s: %w", path, err)
	}
	return d, nil
}

func (doc topologyFile) deployment() (deployment, error) {
	if len(doc.Queues) == 0 && len(doc.Exchanges) == 0 {
		return deployment{}, errors.New("no queues and no exchanges")
	}
	var d deployment
	var errs []error
	seen := map[string]bool{}
	for i, q := range doc.Queues {
		if q.Name == "" {
			errs = append(errs, fmt.Errorf("queue %d: name is required", i+1))
			continue
		}
		if seen[q.Name] {
			errs = append(errs, fmt.Errorf("queue %s: named twice", q.Name))
			continue
		}
		seen[q.Name] = true
		tc, err := q.config()
		if err != nil {
			errs = append(errs, fmt.Errorf("queue %s: %w", q.Name, err))
			continue
		}
		d.queues = append(d.queues, tc)
	}
	seen = map[string]bool{}
	for i, x := range doc.Exchanges {
		switch {
		case x.Name == "":
			errs = append(errs, fmt.Errorf("exchange %d: name is required", i+1))
		case x.Kind == "":
			errs = append(errs, fmt.Errorf("exchange %s: kind is required (direct, fanout, topic, headers)", x.Name))
		case seen[x.Name]:
			errs = append(errs, fmt.Errorf("exchange %s: named twice", x.Name))
		}
		seen[x.Name] = true
	}
	d.exchanges = doc.Exchanges
	return d, errors.Join(errs...)
}

// config is the topology of q, defaults filled, checked as the flags are.
func (q fileQueue) config() (consumer.TopologyConfig, error) {
	var classic bool
	switch q.Kind {
	case "", "quorum":
	case "classic":
		classic = true
	default:
		return consumer.TopologyConfig{}, fmt.Errorf("kind %q: want quorum or classic", q.Kind)
	}
	var bindings []consumer.Binding
	for _, b := range q.Bindings {
		args, err := tableOf(b.Arguments)
		if err != nil {
			return consumer.TopologyConfig{}, fmt.Errorf("binding to %s: arguments: %w", b.Exchange, err)
		}
		bindings = append(bindings, consumer.Binding{Exchange: b.Exchange, Kind: b.Kind, Key: b.Key, Args: args, Declare: b.Declare})
	}
	tc := consumer.TopologyConfig{
		Queue:           q.Name,
		MaxAttempts:     q.Retry.MaxAttempts,
		RetryInitial:    q.Retry.Initial,
		RetryMultiplier: q.Retry.Multiplier,
		RetryMax:        q.Retry.Max,
		DeliveryLimit:   q.DeliveryLimit,
		ClassicQueues:   classic,
		Bindings:        bindings,
		Partitions:      q.Partitions,

		QuorumInitialGroupSize: q.QuorumInitialGroupSize,
	}
	switch {
	case tc.MaxAttempts < 0:
		return tc, fmt.Errorf("retry.max_attempts %d must be at least 1", tc.MaxAttempts)
	case tc.RetryInitial < 0:
		return tc, fmt.Errorf("retry.initial %s must be positive", tc.RetryInitial)
	case tc.RetryMultiplier < 0:
		return tc, fmt.Errorf("retry.multiplier %g must be at least 1", tc.RetryMultiplier)
	case tc.QuorumInitialGroupSize < 0:
		return tc, fmt.Errorf("quorum_initial_group_size %d must not be negative", tc.QuorumInitialGroupSize)
	case tc.DeliveryLimit < 0:
		return tc, fmt.Errorf("delivery_limit %d must be at least 1", tc.DeliveryLimit)
	}
	tc = tc.WithDefaults()
	if tc.RetryMax < tc.RetryInitial {
		return tc, fmt.Errorf("retry.max %s is shorter than retry.initial %s", tc.RetryMax, tc.RetryInitial)
	}
	return tc, tc.Validate()
}

// tableOf turns the arguments of a binding, as YAML decodes them, into an
// AMQP table (integers as 64-bit ones).
func tableOf(m map[string]any) (amqp.Table, error) {
	if len(m) == 0 {
		return nil, nil
	}
	t := amqp.Table{}
	for k, v := range m {
		fv, err := fieldOf(v)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", k, err)
		}
		t[k] = fv
	}
	return t, t.Validate()
}

func fieldOf(v any) (any, error) {
	switch v := v.(type) {
	case int:
		return int64(v), nil
	case string, bool, float64, int64, nil:
		return v, nil
	case map[string]any:
		return tableOf(v)
	case []any:
		out := make([]any, len(v))
		for i, e := range v {
			fe, err := fieldOf(e)
			if err != nil {
				return nil, err
			}
			out[i] = fe
		}
		return out, nil
	}
	return nil, fmt.Errorf("a %T is not an AMQP field value", v)
}

// exchangeKinds are the kinds `--bind` recognises in EXCHANGE:KIND:KEY
// (besides plugins' x-… kinds).
var exchangeKinds = []string{amqp.ExchangeDirect, amqp.ExchangeFanout, amqp.ExchangeTopic, amqp.ExchangeHeaders}

// parseBind reads one --bind EXCHANGE[:KIND]:KEY of work queue queue. With
// a KIND the exchange is declared (idempotently), without one it must
// exist. A headers binding's KEY is its arguments: name=value,… .
func parseBind(queue, s string) (consumer.Binding, error) {
	bad := func(format string, args ...any) error {
		return usagef("--bind %q: %s (want EXCHANGE[:KIND]:KEY)", s, fmt.Sprintf(format, args...))
	}
	parts := strings.SplitN(s, ":", 3)
	if len(parts) == 1 {
		return consumer.Binding{}, bad("no binding key")
	}
	b := consumer.Binding{Exchange: parts[0], Key: strings.Join(parts[1:], ":")}
	if len(parts) == 3 {
		switch kind := parts[1]; {
		case kind == "":
			return consumer.Binding{}, bad("empty kind")
		case slices.Contains(exchangeKinds, kind) || strings.HasPrefix(kind, "x-"):
			b.Kind, b.Key, b.Declare = kind, parts[2], true
		}
	}
	if b.Exchange == "" {
		return consumer.Binding{}, bad("no exchange (the default exchange takes no bindings)")
	}
	if b.Kind == amqp.ExchangeHeaders {
		b.Args = amqp.Table{}
		for _, kv := range strings.Split(b.Key, ",") {
			k, v, ok := strings.Cut(kv, "=")
			if !ok || k == "" {
				return consumer.Binding{}, bad("a headers binding's key is name=value,…; %q is not", kv)
			}
			b.Args[k] = v
		}
		b.Key = ""
	}
	if err := (consumer.TopologyConfig{Queue: queue, Bindings: []consumer.Binding{b}}).WithDefaults().Validate(); err != nil {
		return consumer.Binding{}, bad("%v", err)
	}
	return b, nil
}
