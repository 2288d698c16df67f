package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"reflect"
	"slices"
	"text/tabwriter"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/spf13/cobra"

	"github.com/idemq/idemq/consumer"
)

func (a *app) topologyDiffCommand() *cobra.Command {
	var file, managementURL string
	cmd := &cobra.Command{
		Use:   "diff -f FILE [--management-url URL]",
		Short: "Show what the broker lacks of a topology file, or has with other arguments",
		Long: `Compare the broker with a topology file (the one 'topology apply -f' declares)
and print one line per difference:

  missing  queue     Q.retry.5s
  differs  queue     Q           PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' ...
  missing  exchange  orders
  missing  binding   Q           orders:topic:order.paid

Exit 0 when the broker has everything the file describes, 1 when something
is missing or differs (2 for a malformed file). What the broker has beyond
the file (other queues, other bindings, tiers of an older retry policy) is
not reported.

Queues and exchanges are compared as RabbitMQ compares a redeclaration:
a passive declare finds whether each exists, then a declare with the file's
arguments on a channel of its own is refused (PRECONDITION_FAILED) when an
argument differs. The declare creates nothing, since the queue or exchange
exists; one deleted between the two declares would be created.

AMQP cannot list bindings. With --management-url (the RabbitMQ management
API, e.g. http://127.0.0.1:15672; credentials from that URL, else from
--amqp-url) each work queue's bindings are read from it; without it, only the
bindings of a missing queue are reported (as missing), and the others are
named as not compared.`,
		Example: `  idemq topology diff -f deploy/topology.yaml
  idemq topology diff -f deploy/topology.yaml --management-url http://127.0.0.1:15672`,
		Args: noArgs,
		RunE: run(func(cmd *cobra.Command, _ []string) error {
			d, err := loadTopologyFile(file)
			if err != nil {
				return err
			}
			mgmt, err := parseManagementURL(managementURL)
			if err != nil {
				return err
			}
			conn, err := a.dialAMQP("idemq-topology-diff")
			if err != nil {
				return err
			}
			defer conn.Close()
			c := &differ{ctx: cmd.Context(), a: a, conn: conn, mgmt: mgmt, checked: map[string]bool{}}
			if err := c.deployment(d); err != nil {
				return err
			}
			w := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			for _, l := range c.lines {
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\n", l.state, l.kind, l.name, l.detail)
			}
			_ = w.Flush()
			for _, q := range c.uncompared {
				fmt.Fprintf(a.stdout, "bindings of %s not compared: AMQP cannot list them; give --management-url\n", q)
			}
			if len(c.lines) > 0 {
				return fmt.Errorf("the broker differs from %s in %d places", file, len(c.lines))
			}
			fmt.Fprintf(a.stdout, "no differences: the broker has the %d queues and %d exchanges of %s\n", len(d.queues), len(d.exchanges), file)
			return nil
		}),
	}
	f := cmd.Flags()
	f.StringVarP(&file, "file", "f", "", "the topology file to compare with the broker (required)")
	f.StringVar(&managementURL, "management-url", "", "RabbitMQ management API, to compare the bindings too")
	requireFlags(cmd, "file")
	return cmd
}

// difference is one line of topology diff.
type difference struct {
	state  string // "missing" or "differs"
	kind   string // "queue", "exchange" or "binding"
	name   string // the queue or exchange; for a binding, its queue
	detail string // the broker's refusal, or the binding
}

// differ compares the broker with a deployment.
type differ struct {
	ctx  context.Context
	a    *app
	conn *amqp.Connection
	mgmt *url.URL // nil: bindings are not read

	checked    map[string]bool // exchanges compared already
	lines      []difference
	uncompared []string // work queues whose bindings were not compared
}

func (c *differ) deployment(d deployment) error {
	for _, tc := range d.queues {
		if err := c.workQueue(consumer.NewTopology(tc)); err != nil {
			return err
		}
	}
	for _, x := range d.exchanges {
		if err := c.exchange(x.Name, x.Kind, true); err != nil {
			return err
		}
	}
	return nil
}

func (c *differ) workQueue(t consumer.Topology) error {
	t = t.OnBroker(consumer.BrokerVersion(c.conn))
	if len(t.Partitions) > 0 {
		// Its arguments (the hash header) are not compared: a declare
		// without them would read as a difference.
		if err := c.exchange(t.OrderExchange, "x-consistent-hash", false); err != nil {
			return err
		}
		for _, p := range t.Partitions {
			if err := c.workQueue(p); err != nil {
				return err
			}
		}
		return nil
	}
	if err := c.exchange(t.DLX, amqp.ExchangeFanout, true); err != nil {
		return err
	}
	// The same topology with queues of the other kind: a declare of it
	// that the broker accepts tells a changed kind from other arguments.
	flipped := t
	flipped.ClassicQueues = !t.ClassicQueues
	kinds := [2]string{queueKind(t.ClassicQueues), queueKind(flipped.ClassicQueues)}
	if _, err := c.queue(t.DLQ, kinds, t.DLQArgs(), flipped.DLQArgs()); err != nil {
		return err
	}
	exists, err := c.queue(t.Queue, kinds, t.WorkQueueArgs(), flipped.WorkQueueArgs())
	if err != nil {
		return err
	}
	for _, d := range t.Delays {
		if _, err := c.queue(t.TierName(d), kinds, t.TierArgs(d), flipped.TierArgs(d)); err != nil {
			return err
		}
	}
	for _, b := range t.Bindings {
		if err := c.exchange(b.Exchange, b.Kind, b.Declare); err != nil {
			return err
		}
	}
	if len(t.Bindings) == 0 {
		return nil
	}
	switch {
	case !exists:
		for _, b := range t.Bindings {
			c.lines = append(c.lines, difference{"missing", "binding", t.Queue, b.String()})
		}
	case c.mgmt == nil:
		c.uncompared = append(c.uncompared, t.Queue)
	default:
		var have []managedBinding
		if err := c.a.managementGet(c.ctx, c.mgmt, "queues", "", &have, t.Queue, "bindings"); err != nil {
			return fmt.Errorf("read the bindings of %s: %w", t.Queue, err)
		}
		for _, b := range t.Bindings {
			if !slices.ContainsFunc(have, bindingIs(b)) {
				c.lines = append(c.lines, difference{"missing", "binding", t.Queue, b.String()})
			}
		}
	}
	return nil
}

func queueKind(classic bool) string {
	if classic {
		return "classic"
	}
	return "quorum"
}

// queue reports whether queue exists, and notes it missing, or different
// when a declare with args is refused: of the other kind (kinds: wanted,
// other) when a declare with otherArgs is accepted.
func (c *differ) queue(name string, kinds [2]string, args, otherArgs amqp.Table) (bool, error) {
	declare := func(args amqp.Table) error {
		return c.onChannel(func(ch *amqp.Channel) error {
			_, err := ch.QueueDeclare(name, true, false, false, false, args)
			return err
		})
	}
	err := c.onChannel(func(ch *amqp.Channel) error {
		_, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
		return err
	})
	if isCode(err, amqp.NotFound) {
		c.lines = append(c.lines, difference{"missing", "queue", name, ""})
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("inspect queue %s: %w", name, err)
	}
	err = declare(args)
	if ae := (*amqp.Error)(nil); errors.As(err, &ae) && ae.Code == amqp.PreconditionFailed {
		detail := ae.Reason
		if declare(otherArgs) == nil {
			detail = fmt.Sprintf("a %s queue, the file says %s (x-queue-type)", kinds[1], kinds[0])
		}
		c.lines = append(c.lines, difference{"differs", "queue", name, detail})
		return true, nil
	}
	if err != nil {
		return true, fmt.Errorf("compare queue %s: %w", name, err)
	}
	return true, nil
}

// exchange notes exchange missing, or (when compare is set) different
// from a durable exchange of kind. Each exchange is looked at once.
func (c *differ) exchange(name, kind string, compare bool) error {
	if c.checked[name] {
		return nil
	}
	c.checked[name] = true
	err := c.onChannel(func(ch *amqp.Channel) error {
		return ch.ExchangeDeclarePassive(name, kind, true, false, false, false, nil)
	})
	if isCode(err, amqp.NotFound) {
		c.lines = append(c.lines, difference{"missing", "exchange", name, kind})
		return nil
	}
	if err != nil || !compare {
		return wrapIf(err, "inspect exchange %s", name)
	}
	err = c.onChannel(func(ch *amqp.Channel) error {
		return ch.ExchangeDeclare(name, kind, true, false, false, false, nil)
	})
	if ae := (*amqp.Error)(nil); errors.As(err, &ae) && ae.Code == amqp.PreconditionFailed {
		c.lines = append(c.lines, difference{"differs", "exchange", name, ae.Reason})
		return nil
	}
	return wrapIf(err, "compare exchange %s", name)
}

// onChannel runs fn on a channel of its own: a refused declare closes it.
func (c *differ) onChannel(fn func(*amqp.Channel) error) error {
	ch, err := c.conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	defer ch.Close()
	return fn(ch)
}

func isCode(err error, code int) bool {
	var ae *amqp.Error
	return errors.As(err, &ae) && ae.Code == code
}

func wrapIf(err error, format string, args ...any) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf(format+": %w", append(args, err)...)
}

// managedBinding is a binding as the management API lists a queue's.
type managedBinding struct {
	Source     string         `json:"source"`
	RoutingKey string         `json:"routing_key"`
	Arguments  map[string]any `json:"arguments"`
}

// bindingIs reports whether a binding the management API lists is b:
// same exchange, key and arguments (compared as JSON carries them).
func bindingIs(b consumer.Binding) func(managedBinding) bool {
	want := jsonValue(map[string]any(b.Args))
	return func(have managedBinding) bool {
		return have.Source == b.Exchange && have.RoutingKey == b.Key && reflect.DeepEqual(jsonValue(have.Arguments), want)
	}
}

// jsonValue is v as it reads back from JSON, an empty map for nil.
func jsonValue(v map[string]any) any {
	if len(v) == 0 {
		return map[string]any{}
	}
	raw, err := json.Marshal(v)
	if err != nil {
		return v
	}
	var out any
	if err := json.Unmarshal(raw, &out); err != nil {
		return v
	}
	return out
}
