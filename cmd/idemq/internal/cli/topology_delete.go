package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/spf13/cobra"

	"github.com/idemq/idemq/cmd/idemq/internal/dlq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/redact"
)

// commonDelays are retry delays looked for by name when the management API
// is not given: the tiers of other retry policies than the flags' and the
// default one are found only if their delay is among these.
var commonDelays = []time.Duration{
	100 * time.Millisecond, 200 * time.Millisecond, 250 * time.Millisecond, 500 * time.Millisecond,
	time.Second, 2 * time.Second, 3 * time.Second, 4 * time.Second, 5 * time.Second, 8 * time.Second,
	10 * time.Second, 15 * time.Second, 16 * time.Second, 20 * time.Second, 25 * time.Second, 30 * time.Second,
	32 * time.Second, 45 * time.Second, time.Minute, 64 * time.Second, 2 * time.Minute, 125 * time.Second,
	128 * time.Second, 3 * time.Minute, 5 * time.Minute, 10 * time.Minute, 15 * time.Minute, 20 * time.Minute,
	30 * time.Minute, time.Hour, 2 * time.Hour,
}

// topologyEntity is one queue or exchange of a work queue's topology.
type topologyEntity struct {
	kind     string // "queue" or "exchange"
	name     string
	role     string
	messages int
}

func (a *app) topologyDeleteCommand() *cobra.Command {
	var (
		t             topologyFlags
		yes           bool
		managementURL string
	)
	cmd := &cobra.Command{
		Use:   "delete --queue Q [--yes]",
		Short: "Delete a work queue, its retry tiers, its dead-letter queue and exchange",
		Long: `Delete the RabbitMQ topology of work queue Q: Q, its retry tiers
Q.retry.<delay>, Q.dlq and Q.dlx, with the messages they hold.

Without --yes it only prints what it would delete (with the messages each
queue holds) and exits 2; with --yes it deletes them. What does not exist is
skipped: deleting twice is safe.

The retry tiers are found by name, whatever the retry policy that declared
them. With --management-url (the RabbitMQ management API, e.g.
http://127.0.0.1:15672; credentials from that URL, else from --amqp-url)
every queue of the vhost named Q.retry.<delay> is found. Without it, the
tiers looked for are those of the retry flags given (as to topology apply),
of the default policy, and of common delays (100ms to 2h): a tier of another
delay is left behind; name its policy with the retry flags, or use
--management-url.`,
		Example: `  idemq topology delete --queue payments
  idemq topology delete --queue payments --yes
  idemq topology delete --queue payments --management-url http://127.0.0.1:15672 --yes`,
		Args: noArgs,
		RunE: run(func(cmd *cobra.Command, _ []string) error {
			if err := t.validate(); err != nil {
				return err
			}
			if err := a.checkAMQPURL(); err != nil {
				return err
			}
			mgmt, err := parseManagementURL(managementURL)
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			var tiers []string
			if mgmt != nil {
				queues := []string{t.queue}
				if t.partitions > 0 {
					queues = nil
					for i := range t.partitions {
						queues = append(queues, consumer.PartitionQueue(t.queue, i))
					}
				}
				for _, q := range queues {
					found, err := a.managementTiers(ctx, mgmt, q)
					if err != nil {
						return err
					}
					tiers = append(tiers, found...)
				}
			}
			conn, err := a.dialAMQP("idemq-topology-delete")
			if err != nil {
				return err
			}
			defer conn.Close()
			found, err := findTopology(conn, t, tiers)
			if err != nil {
				return err
			}
			if len(found) == 0 {
				fmt.Fprintf(a.stdout, "nothing to delete: no queue or exchange of %s exists\n", t.queue)
				return nil
			}
			if !yes {
				fmt.Fprintln(a.stdout, "would delete:")
				printEntities(a, found)
				return usagef("nothing deleted: run again with --yes to delete these %d", len(found))
			}
			return deleteTopology(a, conn, found)
		}),
	}
	f := cmd.Flags()
	t.register(f)
	f.BoolVar(&yes, "yes", false, "delete (without it: print what would be deleted, exit 2)")
	f.StringVar(&managementURL, "management-url", "", "RabbitMQ management API, to find every retry tier by name whatever its delay")
	requireFlags(cmd, "queue")
	return cmd
}

// findTopology returns what exists of work queue t.queue's topology: the
// work queue, its retry tiers (those of the flags' policy, of the default
// policy, of the common delays, and those named in extraTiers), its DLQ and
// its DLX, in the order they are deleted.
func findTopology(conn *amqp.Connection, t topologyFlags, extraTiers []string) ([]topologyEntity, error) {
	if t.partitions > 0 {
		var found []topologyEntity
		for i := range t.partitions {
			p := t
			p.queue, p.partitions = consumer.PartitionQueue(t.queue, i), 0
			f, err := findTopology(conn, p, extraTiers)
			if err != nil {
				return nil, err
			}
			found = append(found, f...)
		}
		x := consumer.OrderExchange(t.queue)
		ok, err := exchangeExists(conn, x)
		if err != nil {
			return nil, err
		}
		if ok {
			found = append(found, topologyEntity{kind: "exchange", name: x, role: "partitions' exchange"})
		}
		return found, nil
	}
	var cfg consumer.Config
	t.apply(&cfg)
	topo := consumer.NewTopology(cfg.TopologyConfig())
	defaults := consumer.NewTopology(consumer.TopologyConfig{Queue: t.queue})
	delays := slices.Concat(topo.Delays, defaults.Delays, commonDelays)
	for _, name := range extraTiers {
		if d, ok := tierDelay(t.queue, name); ok {
			delays = append(delays, d)
		}
	}
	slices.Sort(delays)
	var tiers []string
	for _, d := range slices.Compact(delays) {
		tiers = append(tiers, topo.TierName(d))
	}

	var found []topologyEntity
	check := func(name, role string) error {
		n, ok, err := queueMessages(conn, name)
		if ok {
			found = append(found, topologyEntity{kind: "queue", name: name, role: role, messages: n})
		}
		return err
	}
	if err := check(topo.Queue, "work queue"); err != nil {
		return nil, err
	}
	for _, name := range tiers {
		if err := check(name, "retry tier"); err != nil {
			return nil, err
		}
	}
	if err := check(topo.DLQ, "dead-letter queue"); err != nil {
		return nil, err
	}
	ok, err := exchangeExists(conn, topo.DLX)
	if err != nil {
		return nil, err
	}
	if ok {
		found = append(found, topologyEntity{kind: "exchange", name: topo.DLX, role: "dead-letter exchange"})
	}
	return found, nil
}

// queueMessages reports the ready messages of queue (dlq.Inspect, a
// passive declare on a channel of its own): ok false when it does not exist.
func queueMessages(conn *amqp.Connection, queue string) (messages int, ok bool, err error) {
	q, err := dlq.Inspect(conn, queue)
	if errors.Is(err, dlq.ErrNoQueue) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, err
	}
	return q.Messages, true, nil
}

// exchangeExists passively declares exchange on a channel of its own.
func exchangeExists(conn *amqp.Connection, exchange string) (bool, error) {
	ch, err := conn.Channel()
	if err != nil {
		return false, fmt.Errorf("open channel: %w", err)
	}
	defer ch.Close()
	err = ch.ExchangeDeclarePassive(exchange, amqp.ExchangeFanout, true, false, false, false, nil)
	var ae *amqp.Error
	if errors.As(err, &ae) && ae.Code == amqp.NotFound {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("inspect exchange %s: %w", exchange, err)
	}
	return true, nil
}

func printEntities(a *app, found []topologyEntity) {
	w := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	for _, e := range found {
		fmt.Fprintf(w, "%s\t%s\t%s", e.kind, e.name, e.role)
		if e.kind == "queue" {
			fmt.Fprintf(w, ", %s", messages(e.messages))
		}
		fmt.Fprintln(w)
	}
	_ = w.Flush()
}

// messages is "1 message" or "n messages".
func messages(n int) string {
	if n == 1 {
		return "1 message"
	}
	return fmt.Sprintf("%d messages", n)
}

// deleteTopology deletes found, queues with their messages.
func deleteTopology(a *app, conn *amqp.Connection, found []topologyEntity) error {
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	defer ch.Close()
	for _, e := range found {
		switch e.kind {
		case "queue":
			n, err := ch.QueueDelete(e.name, false, false, false)
			if err != nil {
				return fmt.Errorf("delete queue %s: %w", e.name, err)
			}
			fmt.Fprintf(a.stdout, "deleted queue %s (%s, %s)\n", e.name, e.role, messages(n))
		case "exchange":
			if err := ch.ExchangeDelete(e.name, false, false); err != nil {
				return fmt.Errorf("delete exchange %s: %w", e.name, err)
			}
			fmt.Fprintf(a.stdout, "deleted exchange %s (%s)\n", e.name, e.role)
		}
	}
	return nil
}

// managementTiers lists the queues of --amqp-url's vhost through the
// management API and returns those named like a retry tier of queue:
// queue.retry.<a duration>.
func (a *app) managementTiers(ctx context.Context, mgmt *url.URL, queue string) ([]string, error) {
	var queues []managedQueue
	if err := a.managementGet(ctx, mgmt, "queues", "?columns=name", &queues); err != nil {
		return nil, fmt.Errorf("list queues through the management API: %w", err)
	}
	return retryTiers(queue, queues), nil
}

// parseManagementURL checks --management-url: nil when it is not given.
func parseManagementURL(s string) (*url.URL, error) {
	if s == "" {
		return nil, nil
	}
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, usagef("--management-url %s: want an http:// or https:// URL", redact.URL(s))
	}
	return u, nil
}

// managementGet reads /api/<what>/<vhost of --amqp-url>[/<more…>]<query>
// from the management API into out, with the credentials of mgmt, else
// those of --amqp-url. Each of more is one escaped path segment.
func (a *app) managementGet(ctx context.Context, mgmt *url.URL, what, query string, out any, more ...string) error {
	// The nodes of a cluster share their users and vhosts: the first URL
	// stands for the list.
	addrs, err := a.amqpAddrs()
	if err != nil {
		return err
	}
	uri, err := amqp.ParseURI(addrs.First())
	if err != nil {
		return usagef("--amqp-url: %s", redact.Error(err))
	}
	user, pass := uri.Username, uri.Password
	if mgmt.User != nil {
		user = mgmt.User.Username()
		pass, _ = mgmt.User.Password()
	}
	base := *mgmt
	base.User, base.RawQuery, base.Fragment = nil, "", ""
	// The vhost is one path segment: "/" is %2F.
	endpoint := strings.TrimSuffix(base.String(), "/") + "/api/" + what + "/" + url.PathEscape(uri.Vhost)
	for _, seg := range more {
		endpoint += "/" + url.PathEscape(seg)
	}
	endpoint += query
	rctx, cancel := context.WithTimeout(ctx, 2*a.connectTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(rctx, http.MethodGet, endpoint, nil)
	if err != nil {
		return fmt.Errorf("management API request: %w", err)
	}
	req.SetBasicAuth(user, pass)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("management API at %s: %s", redact.URL(mgmt.String()), cause(err, a.connectTimeout))
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("management API at %s: %s", redact.URL(mgmt.String()), resp.Status)
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return fmt.Errorf("management API answer: %w", err)
	}
	return nil
}

// managedQueue is a queue as the management API lists it.
type managedQueue struct {
	Name string `json:"name"`
}

// retryTiers picks the names of queue's retry tiers among queues: those
// named queue.retry.<delay>, with a delay as a time.Duration prints it.
func retryTiers(queue string, queues []managedQueue) []string {
	var tiers []string
	for _, q := range queues {
		if _, ok := tierDelay(queue, q.Name); ok {
			tiers = append(tiers, q.Name)
		}
	}
	return tiers
}

// tierDelay is the delay of name when it is a retry tier of queue.
func tierDelay(queue, name string) (time.Duration, bool) {
	rest, ok := strings.CutPrefix(name, queue+".retry.")
	if !ok {
		return 0, false
	}
	d, err := time.ParseDuration(rest)
	if err != nil || d <= 0 || d.String() != rest {
		return 0, false
	}
	return d, true
}
