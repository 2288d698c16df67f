package cli

import (
	"errors"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/idemq/idemq/consumer"
)

// topologyFlags are the flags that shape a work queue's topology. The
// forward command takes them too: its consumer declares the same topology
// on every connect, and RabbitMQ refuses a queue redeclared with other arguments.
type topologyFlags struct {
	queue           string
	maxAttempts     int
	retryInitial    time.Duration
	retryMultiplier float64
	retryMax        time.Duration
	deliveryLimit   int
	classic         bool
	groupSize       int
	partitions      int
}

func (t *topologyFlags) register(f *pflag.FlagSet) {
	f.StringVar(&t.queue, "queue", "", "the work queue Q (required)")
	f.IntVar(&t.maxAttempts, "max-attempts", consumer.DefaultMaxAttempts, "handler runs before a message goes to the DLQ with reason max_attempts_exceeded")
	f.DurationVar(&t.retryInitial, "retry-initial", consumer.DefaultRetryInitial, "delay before the first retry")
	f.Float64Var(&t.retryMultiplier, "retry-multiplier", consumer.DefaultRetryMultiplier, "growth of the delay from one retry to the next")
	f.DurationVar(&t.retryMax, "retry-max", consumer.DefaultRetryMax, "longest retry delay")
	f.IntVar(&t.deliveryLimit, "delivery-limit", consumer.DefaultDeliveryLimit, "the work queue's x-delivery-limit: the broker dead-letters a message delivered more often")
	f.BoolVar(&t.classic, "classic", false, "declare classic queues instead of quorum queues (broker dead-lettering is then at-most-once)")
	f.IntVar(&t.partitions, "partitions", 0, "split Q into N partitions for ordered consumption: exchange Q.order (x-consistent-hash on x-ordering-key) and queues Q.p0 … Q.p{N-1}, each single-active-consumer with its tiers and DLQ (docs/ordering.md)")
	f.IntVar(&t.groupSize, "quorum-initial-group-size", 0, "x-quorum-initial-group-size of the quorum queues: nodes that get a replica at declaration (0: the broker's default, 3)")
}

func (t *topologyFlags) validate() error {
	switch {
	case t.queue == "":
		return usagef("--queue must not be empty")
	case t.maxAttempts < 1:
		return usagef("--max-attempts %d must be at least 1", t.maxAttempts)
	case t.retryInitial <= 0:
		return usagef("--retry-initial %s must be positive", t.retryInitial)
	case t.retryMultiplier < 1:
		return usagef("--retry-multiplier %g must be at least 1", t.retryMultiplier)
	case t.retryMax < t.retryInitial:
		return usagef("--retry-max %s is shorter than --retry-initial %s", t.retryMax, t.retryInitial)
	case t.deliveryLimit < 1:
		return usagef("--delivery-limit %d must be at least 1", t.deliveryLimit)
	case t.groupSize < 0:
		return usagef("--quorum-initial-group-size %d must not be negative", t.groupSize)
	case t.partitions < 0 || t.partitions > consumer.MaxPartitions:
		return usagef("--partitions %d must be between 0 and %d", t.partitions, consumer.MaxPartitions)
	}
	return nil
}

// config is the topology the flags shape.
func (t *topologyFlags) config() consumer.TopologyConfig {
	return consumer.TopologyConfig{
		Queue:           t.queue,
		MaxAttempts:     t.maxAttempts,
		RetryInitial:    t.retryInitial,
		RetryMultiplier: t.retryMultiplier,
		RetryMax:        t.retryMax,
		DeliveryLimit:   t.deliveryLimit,
		ClassicQueues:   t.classic,
		Partitions:      t.partitions,

		QuorumInitialGroupSize: t.groupSize,
	}
}

// apply copies the flags into a consumer config, whose consumer then
// declares the same topology as `topology apply` with these flags.
func (t *topologyFlags) apply(c *consumer.Config) {
	tc := t.config()
	c.Queue = tc.Queue
	c.MaxAttempts = tc.MaxAttempts
	c.RetryInitial = tc.RetryInitial
	c.RetryMultiplier = tc.RetryMultiplier
	c.RetryMax = tc.RetryMax
	c.DeliveryLimit = tc.DeliveryLimit
	c.ClassicQueues = tc.ClassicQueues
	c.QuorumInitialGroupSize = tc.QuorumInitialGroupSize
	c.Partitions = tc.Partitions
}

func (a *app) topologyCommand() *cobra.Command {
	var (
		t     topologyFlags
		binds []string
		file  string
	)
	apply := &cobra.Command{
		Use:   "apply (--queue Q [--bind EXCHANGE[:KIND]:KEY]... | -f FILE)",
		Short: "Declare a work queue, its retry tiers and its dead-letter queue",
		Long: `Declare the RabbitMQ topology of work queue Q:

  Q                 quorum queue with x-delivery-limit, dead-lettering to Q.dlx
  Q.retry.<delay>   one delay tier per retry delay (x-message-ttl, dead-letters back to Q)
  Q.dlx → Q.dlq     the dead-letter exchange (fanout) and queue

The retry delays follow an exponential backoff: --retry-initial, multiplied by
--retry-multiplier each time, capped by --retry-max, one per retry
(--max-attempts - 1 of them). Declaring is idempotent: applying the same flags
again changes nothing. RabbitMQ refuses to redeclare a queue with other
arguments; delete it first to change them. Consumers (idemq forward) declare
the same topology on connect, so give them the same flags.

--bind EXCHANGE[:KIND]:KEY (repeatable) binds Q to an exchange publishers
publish to. With a KIND (direct, fanout, topic, headers, x-…) the exchange is
declared, durable; without one it must exist. A headers binding's KEY is the
arguments it matches: x-match=all,type=refund. Retry and dead-letter copies
never go back through these exchanges.

--partitions N declares a partitioned Q for ordered consumption instead: the
exchange Q.order (x-consistent-hash, hashing the header x-ordering-key), which
publishers publish to, and N queues Q.p0 … Q.p{N-1}, each quorum with
single-active-consumer, bound with weight 1, with its own retry tiers and DLQ.
'idemq forward --partitions N' consumes them (docs/ordering.md).

-f FILE declares every work queue and exchange of a topology file instead
(docs/topology.md); 'idemq topology diff -f FILE' compares it with the broker.`,
		Example: `  idemq topology apply --queue payments
  idemq topology apply --queue payments --max-attempts 4 --retry-initial 500ms --retry-multiplier 4 --retry-max 1m
  idemq topology apply --queue payments --bind orders:topic:order.created --bind orders:topic:order.paid
  idemq topology apply --queue ledger --partitions 4
  idemq topology apply -f deploy/topology.yaml`,
		Args: noArgs,
		RunE: run(func(cmd *cobra.Command, _ []string) error {
			d, err := t.deployment(cmd, binds, file)
			if err != nil {
				return err
			}
			conn, err := a.dialAMQP("idemq-topology-apply")
			if err != nil {
				return err
			}
			defer conn.Close()
			ch, err := conn.Channel()
			if err != nil {
				return fmt.Errorf("open channel: %w", err)
			}
			defer ch.Close()
			for _, x := range d.exchanges {
				if err := ch.ExchangeDeclare(x.Name, x.Kind, true, false, false, false, nil); err != nil {
					return refusal(fmt.Errorf("declare exchange %s (%s): %w", x.Name, x.Kind, err))
				}
			}
			for _, tc := range d.queues {
				topo := consumer.NewTopology(tc).OnBroker(consumer.BrokerVersion(conn))
				if err := topo.Declare(ch); err != nil {
					return refusal(err)
				}
				printTopology(a, topo)
			}
			for _, x := range d.exchanges {
				fmt.Fprintf(a.stdout, "exchange  %s  outbox target (%s)\n", x.Name, x.Kind)
			}
			return nil
		}),
	}
	f := apply.Flags()
	t.register(f)
	f.StringArrayVar(&binds, "bind", nil, "bind Q to EXCHANGE[:KIND]:KEY, declaring the exchange when KIND is given (repeatable)")
	f.StringVarP(&file, "file", "f", "", "declare every work queue and exchange of this topology file")
	apply.MarkFlagsOneRequired("queue", "file")
	return group("topology", "Manage the RabbitMQ topology of work queues", "", apply, a.topologyDiffCommand(), a.topologyDeleteCommand())
}

// refusal adds a hint to a broker's refusal of a queue redeclared with
// other arguments.
func refusal(err error) error {
	var ae *amqp.Error
	if errors.As(err, &ae) && ae.Code == amqp.PreconditionFailed {
		return fmt.Errorf("%w (a queue or exchange exists with other arguments: delete it, or apply the settings it was declared with; 'idemq topology diff' shows them)", err)
	}
	return err
}

// deployment is what apply declares: the topology file, or the one work
// queue the flags shape. The two do not mix.
func (t *topologyFlags) deployment(cmd *cobra.Command, binds []string, file string) (deployment, error) {
	if file != "" {
		var given []string
		cmd.Flags().Visit(func(f *pflag.Flag) {
			if f.Name != "file" && cmd.LocalFlags().Lookup(f.Name) != nil {
				given = append(given, "--"+f.Name)
			}
		})
		if len(given) > 0 {
			return deployment{}, usagef("-f describes every queue: %s does not go with it", strings.Join(given, ", "))
		}
		return loadTopologyFile(file)
	}
	if err := t.validate(); err != nil {
		return deployment{}, err
	}
	tc := t.config()
	for _, s := range binds {
		b, err := parseBind(t.queue, s)
		if err != nil {
			return deployment{}, err
		}
		tc.Bindings = append(tc.Bindings, b)
	}
	return deployment{queues: []consumer.TopologyConfig{tc}}, nil
}

func printTopology(a *app, topo consumer.Topology) {
	if len(topo.Partitions) > 0 {
		fmt.Fprintf(a.stdout, "exchange  %s  partitions' exchange (x-consistent-hash on %s, %d partitions)\n",
			topo.OrderExchange, consumer.HeaderOrderingKey, len(topo.Partitions))
		for _, p := range topo.Partitions {
			printTopology(a, p)
		}
		return
	}
	kind := "quorum"
	if topo.ClassicQueues {
		kind = "classic"
	}
	w := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(w, "queue\t%s\twork queue (%s", topo.Queue, kind)
	if !topo.ClassicQueues {
		fmt.Fprintf(w, ", x-delivery-limit %d", topo.DeliveryLimit)
	}
	if topo.SingleActiveConsumer {
		fmt.Fprintf(w, ", single active consumer")
	}
	fmt.Fprintf(w, ", dead-letters to %s)\n", topo.DLX)
	if topo.OrderExchange != "" {
		fmt.Fprintf(w, "binding\t%s:1\t%s ← %s (a partition, weight 1)\n", topo.OrderExchange, topo.Queue, topo.OrderExchange)
	}
	for _, d := range topo.Delays {
		fmt.Fprintf(w, "queue\t%s\tretry tier (%s, TTL %s, back to %s)\n", topo.TierName(d), kind, d, topo.Queue)
	}
	fmt.Fprintf(w, "exchange\t%s\tdead-letter exchange (fanout)\n", topo.DLX)
	fmt.Fprintf(w, "queue\t%s\tdead-letter queue (%s)\n", topo.DLQ, kind)
	for _, b := range topo.Bindings {
		how := "existing exchange"
		if b.Declare {
			how = "exchange declared"
		}
		fmt.Fprintf(w, "binding\t%s\t%s ← %s (%s)\n", b, topo.Queue, b.Exchange, how)
	}
	_ = w.Flush()
}
