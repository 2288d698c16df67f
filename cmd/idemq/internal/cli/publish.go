package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/confirm"
)

// DefaultPublishConfirmTimeout bounds the wait for the confirms of
// `idemq publish`.
const DefaultPublishConfirmTimeout = 30 * time.Second

// publishFlags are the flags of `idemq publish`.
type publishFlags struct {
	queue, exchange, routingKey string
	key, body, contentType      string
	tenant, tenantHeader        string
	headers                     []string
	bodyGiven                   bool
	copies, concurrency         int
	confirmTimeout              time.Duration
}

func (a *app) publishCommand() *cobra.Command {
	var p publishFlags
	cmd := &cobra.Command{
		Use:   "publish (--queue Q | --exchange X [--routing-key K]) --key KEY [--body TEXT | --body @FILE]",
		Short: "Publish a test message, or N copies of it, with publisher confirms",
		Long: `Publish a message to try a consumer by hand: to work queue Q (--queue, through
the default exchange) or to exchange X with routing key K (--exchange,
--routing-key). The message is persistent, its message_id is --key (the
idempotency key; --key "" publishes a message without one), its body is
--body (@FILE reads a file, - or no --body reads stdin). --tenant sets the
tenant header (--tenant-header, default x-tenant-id); --header k=v adds a
header (repeatable).

--copies N publishes N copies of the same message (same key, same body):
duplicates, as a publisher that retries makes them; --concurrency C sends
them on C channels at once, a burst of concurrent copies.

Every publish is mandatory and confirmed: the command waits for the
broker's confirm of each copy and prints how many were confirmed. It exits
1 when any copy was not confirmed: returned as unroutable (no queue bound),
nacked, or not confirmed within --confirm-timeout. The raw key is not
printed.`,
		Example: `  idemq publish --queue payments --key order-1001 --body '{"account":"a-1","amount":4200}'
  idemq publish --queue payments --key order-1001 --body @payment.json --copies 20 --concurrency 20
  idemq publish --exchange payments.in --routing-key eu --key order-7 --tenant acme --header source=manual < payment.json`,
		Args: noArgs,
		RunE: run(func(cmd *cobra.Command, _ []string) error {
			p.bodyGiven = cmd.Flags().Changed("body")
			msg, err := p.message()
			if err != nil {
				return err
			}
			if err := a.checkAMQPURL(); err != nil {
				return err
			}
			exchange, routingKey := p.exchange, p.routingKey
			target := fmt.Sprintf("exchange %s, routing key %q", exchange, routingKey)
			if p.queue != "" {
				exchange, routingKey = "", p.queue
				target = "queue " + p.queue
			}
			conn, err := a.dialAMQP("idemq-publish")
			if err != nil {
				return err
			}
			defer conn.Close()
			res, err := publishCopies(cmd.Context(), conn, exchange, routingKey, msg, p.copies, p.concurrency, p.confirmTimeout)
			fmt.Fprintf(a.stdout, "published %d of %d to %s: %d confirmed", res.sent, p.copies, target, res.confirmed)
			for _, f := range res.failures() {
				fmt.Fprintf(a.stdout, ", %s", f)
			}
			fmt.Fprintln(a.stdout)
			if err != nil {
				return err
			}
			if res.confirmed < p.copies {
				return fmt.Errorf("%d of %d copies not confirmed (%s)", p.copies-res.confirmed, p.copies, strings.Join(res.failures(), ", "))
			}
			return nil
		}),
	}
	f := cmd.Flags()
	f.StringVar(&p.queue, "queue", "", "publish to this work queue (default exchange, routing key Q)")
	f.StringVar(&p.exchange, "exchange", "", "publish to this exchange (with --routing-key) instead of a queue")
	f.StringVar(&p.routingKey, "routing-key", "", "routing key, with --exchange")
	f.StringVar(&p.key, "key", "", `idempotency key, sent as message_id ("" for none) (required)`)
	f.StringVar(&p.body, "body", "", "message body; @FILE reads FILE, - reads stdin (default: stdin)")
	f.StringVar(&p.contentType, "content-type", "", "content type of the message (e.g. application/json)")
	f.StringVar(&p.tenant, "tenant", "", "tenant of the key, sent in --tenant-header")
	f.StringVar(&p.tenantHeader, "tenant-header", consumer.DefaultTenantHeader, "header carrying the tenant")
	f.StringArrayVar(&p.headers, "header", nil, "header k=v to add (repeatable)")
	f.IntVar(&p.copies, "copies", 1, "copies of the message to publish (same key, same body)")
	f.IntVar(&p.concurrency, "concurrency", 1, "channels publishing the copies at once")
	f.DurationVar(&p.confirmTimeout, "confirm-timeout", DefaultPublishConfirmTimeout, "how long to wait for the broker to confirm the copies")
	requireFlags(cmd, "key")
	return cmd
}

// message checks the flags and builds the message they describe.
func (p *publishFlags) message() (amqp.Publishing, error) {
	var msg amqp.Publishing
	switch {
	case p.queue == "" && p.exchange == "":
		return msg, usagef("give --queue Q, or --exchange X (with --routing-key)")
	case p.queue != "" && (p.exchange != "" || p.routingKey != ""):
		return msg, usagef("--queue publishes through the default exchange: give either --queue or --exchange and --routing-key")
	case p.copies < 1:
		return msg, usagef("--copies %d must be at least 1", p.copies)
	case p.concurrency < 1:
		return msg, usagef("--concurrency %d must be at least 1", p.concurrency)
	case p.confirmTimeout <= 0:
		return msg, usagef("--confirm-timeout %s must be positive", p.confirmTimeout)
	case p.tenant != "" && p.tenantHeader == "":
		return msg, usagef("--tenant-header must not be empty with --tenant")
	}
	headers := amqp.Table{}
	for _, h := range p.headers {
		k, v, ok := strings.Cut(h, "=")
		if !ok || k == "" {
			return msg, usagef("--header %q: want name=value", h)
		}
		headers[k] = v
	}
	if p.tenant != "" {
		headers[p.tenantHeader] = p.tenant
	}
	body, err := p.readBody()
	if err != nil {
		return msg, err
	}
	msg = amqp.Publishing{
		MessageId:    p.key,
		ContentType:  p.contentType,
		DeliveryMode: amqp.Persistent,
		Timestamp:    time.Now().UTC().Truncate(time.Second),
		Body:         body,
	}
	if len(headers) > 0 {
		msg.Headers = headers
	}
	return msg, nil
}

// readBody reads the body: the text of --body (--body "" is an empty
// body), the file of --body @FILE, or stdin for --body - or no --body
// (refused when stdin is a terminal).
func (p *publishFlags) readBody() ([]byte, error) {
	switch {
	case strings.HasPrefix(p.body, "@"):
		b, err := os.ReadFile(p.body[1:])
		if err != nil {
			return nil, usagef("--body %s: %w", p.body, err)
		}
		return b, nil
	case p.bodyGiven && p.body != "-":
		return []byte(p.body), nil
	}
	if !p.bodyGiven && term.IsTerminal(int(os.Stdin.Fd())) {
		return nil, usagef("give the body with --body TEXT or --body @FILE, or on stdin")
	}
	b, err := io.ReadAll(os.Stdin)
	if err != nil {
		return nil, fmt.Errorf("read the body from stdin: %w", err)
	}
	return b, nil
}

// publishResult counts the fates of the copies.
type publishResult struct {
	mu                                               sync.Mutex
	sent, confirmed, unroutable, nacked, unconfirmed int
}

func (r *publishResult) add(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case err == nil:
		r.confirmed++
	case errors.Is(err, confirm.ErrUnroutable):
		r.unroutable++
	case errors.Is(err, confirm.ErrNacked):
		r.nacked++
	default:
		r.unconfirmed++
	}
}

// failures names the copies that were sent and not confirmed, by fate.
func (r *publishResult) failures() []string {
	var out []string
	for _, f := range []struct {
		n    int
		what string
	}{
		{r.unroutable, "returned unroutable (no queue bound)"},
		{r.nacked, "nacked"},
		{r.unconfirmed, "not confirmed"},
	} {
		if f.n > 0 {
			out = append(out, fmt.Sprintf("%d %s", f.n, f.what))
		}
	}
	return out
}

// publishCopies publishes copies of msg on concurrency channels of conn,
// each with its own confirmed publisher, and waits for every confirm (at
// most timeout). The error is the first failure to send, if any; the
// copies' fates are in the result.
func publishCopies(ctx context.Context, conn *amqp.Connection, exchange, routingKey string, msg amqp.Publishing, copies, concurrency int, timeout time.Duration) (*publishResult, error) {
	res := &publishResult{}
	concurrency = min(concurrency, copies)
	pubs := make([]*confirm.Publisher, concurrency)
	closes := make([]chan *amqp.Error, concurrency)
	for i := range pubs {
		ch, err := conn.Channel()
		if err != nil {
			return res, fmt.Errorf("open channel: %w", err)
		}
		defer ch.Close()
		// The broker closes the channel of a publish to an exchange that
		// does not exist: its reason says why the copies were not confirmed.
		closes[i] = ch.NotifyClose(make(chan *amqp.Error, 1))
		if pubs[i], err = confirm.New(ch, conn.Config.FrameSize); err != nil {
			return res, err
		}
	}
	wctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	errs := make([]error, concurrency)
	var wg sync.WaitGroup
	for i, pub := range pubs {
		n := copies / concurrency
		if i < copies%concurrency {
			n++
		}
		wg.Go(func() {
			pending := make([]*confirm.Pending, 0, n)
			for range n {
				pd, err := pub.Publish(ctx, exchange, routingKey, msg)
				if err != nil {
					errs[i] = err
					break
				}
				pending = append(pending, pd)
			}
			res.mu.Lock()
			res.sent += len(pending)
			res.mu.Unlock()
			for _, pd := range pending {
				res.add(pd.Wait(wctx))
			}
		})
	}
	wg.Wait()
	for _, c := range closes {
		select {
		case e, ok := <-c:
			if ok && e != nil {
				return res, fmt.Errorf("the broker closed the channel: %w", e)
			}
		default:
		}
	}
	if err := errors.Join(errs...); err != nil {
		return res, err
	}
	return res, nil
}
