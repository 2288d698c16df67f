// Package amqpdial owns idemq's connects to RabbitMQ: a list of broker
// addresses, tried in a fresh random order on every connect, each attempt
// bounded, the connection named, and every error reported without
// credentials.
//
// # Addresses
//
// Wherever idemq takes an AMQP URL it takes a list: several URLs separated by
// commas ("amqp://u:p@node1:5672/,amqp://u:p@node2:5672/"). A comma inside a
// URL (in a password, say) stays part of it: a piece without "://" belongs
// to the URL before it. Every URL is parsed
// up front, so a mistake anywhere in the list is reported before any connect.
//
// # Dialling
//
// Dialer.Dial makes one pass over the list, in an order shuffled anew on
// each call, so that workers spread over a cluster's nodes and a dead node is
// not always tried first. The first connection opened wins. A refusal of the
// credentials or the vhost (403 ACCESS_REFUSED, 530 NOT_ALLOWED) ends the
// pass: a RabbitMQ cluster's users, vhosts and permissions are the same on
// every node, so the next node would refuse too. Backoff between passes is the
// caller's: each of idemq's reconnect loops already has one.
package amqpdial

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"net"
	"net/url"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/cork"
	"github.com/idemq/idemq/internal/redact"
)

// DefaultTimeout bounds one address's attempt (TCP connect, TLS and AMQP
// handshakes) where a Dialer leaves Timeout zero: amqp091-go's own bound.
const DefaultTimeout = 30 * time.Second

// DefaultHeartbeat is the heartbeat asked for where the base config leaves it
// zero: a dead peer is noticed within about twice that.
const DefaultHeartbeat = 10 * time.Second

// Addrs is a parsed, non-empty list of broker URLs.
type Addrs struct{ urls []string }

// Parse reads broker URLs: each of list is one URL or several separated by
// commas. Every URL must parse as an AMQP URI (amqp091-go's ParseURI); the
// error names the first that does not, redacted, with its place in the list.
func Parse(list ...string) (Addrs, error) {
	var urls []string
	for _, s := range list {
		urls = append(urls, split(s)...)
	}
	if len(urls) == 0 {
		return Addrs{}, errors.New("no broker URL")
	}
	for i, u := range urls {
		if u == "" {
			return Addrs{}, fmt.Errorf("broker URL %d of %d is empty", i+1, len(urls))
		}
		if _, err := amqp.ParseURI(u); err != nil {
			return Addrs{}, badURL(u, i, len(urls), err)
		}
	}
	return Addrs{urls: urls}, nil
}

// badURL describes the i-th of n URLs, u, that amqp091-go cannot parse
// (err), without its credentials. A URL that does not even parse as a URL
// cannot be redacted with confidence (its user and password may hold the
// reserved characters that broke it), so neither it nor the parser's text,
// which quotes it, is repeated.
func badURL(u string, i, n int, err error) error {
	where := ""
	if n > 1 {
		where = fmt.Sprintf(" %d of %d", i+1, n)
	}
	parsed, perr := url.Parse(u)
	if perr != nil {
		return fmt.Errorf("broker URL%s does not parse as a URL: percent-encode the reserved characters (/ ? # @ :) of its user name and password", where)
	}
	reason := redact.Error(err)
	if user := parsed.User; user != nil {
		pw, _ := user.Password()
		if (pw != "" && strings.Contains(reason, pw)) || (user.Username() != "" && strings.Contains(reason, user.Username())) {
			reason = "not an AMQP URL"
		}
	}
	if where != "" {
		where = " (" + where[1:] + ")"
	}
	return fmt.Errorf("broker URL %s%s: %s", redact.URL(u), where, reason)
}

// split cuts s at the commas followed by a new URL (a scheme and "://");
// blanks around each URL are dropped. "" is no URL at all.
func split(s string) []string {
	if strings.TrimSpace(s) == "" {
		return nil
	}
	var out []string
	for piece := range strings.SplitSeq(s, ",") {
		t := strings.TrimSpace(piece)
		if len(out) > 0 && t != "" && !strings.Contains(t, "://") {
			// A comma inside the URL before: put it back.
			out[len(out)-1] += "," + piece
			continue
		}
		out = append(out, t)
	}
	for i := range out {
		out[i] = strings.TrimSpace(out[i])
	}
	return out
}

// Len is the number of addresses.
func (a Addrs) Len() int { return len(a.urls) }

// URLs returns the addresses in the order given (credentials included: not
// for logs).
func (a Addrs) URLs() []string { return append([]string(nil), a.urls...) }

// First returns the first address given, the one whose vhost and
// credentials stand for the list where one URL is needed (the management
// API's).
func (a Addrs) First() string {
	if len(a.urls) == 0 {
		return ""
	}
	return a.urls[0]
}

// String returns the addresses, redacted, separated by commas: for logs and
// errors.
func (a Addrs) String() string {
	r := make([]string, len(a.urls))
	for i, u := range a.urls {
		r[i] = redact.URL(u)
	}
	return strings.Join(r, ",")
}

// Dialer opens connections to the first answering address of a list.
type Dialer struct {
	// Addrs are the broker addresses.
	Addrs Addrs
	// Name is the client-provided connection name, shown by RabbitMQ.
	Name string
	// Config, when set, is the base connection config (TLS, vhost,
	// heartbeat, SASL). Its properties are copied, never changed. When it
	// has a Dial function of its own, Timeout does not apply.
	Config *amqp.Config
	// Timeout bounds each address's attempt: the TCP connect and the TLS and
	// AMQP handshakes. Default DefaultTimeout.
	Timeout time.Duration

	// shuffle orders the indexes of a pass; nil: a random permutation.
	shuffle func(n int) []int
}

// Dial makes one pass over the addresses in a fresh random order and returns
// the first connection opened. It ends early when ctx ends (its deadline
// bounds every attempt too) and when the broker refuses the credentials or
// the vhost. Its error, an *Error, names every address tried, redacted.
func (d *Dialer) Dial(ctx context.Context) (*amqp.Connection, error) {
	conn, _, err := d.DialHeld(ctx)
	return conn, err
}

// DialHeld is Dial, and returns with the connection the cork.Conn that
// carries its bytes, so that a publisher can send a batch in one write
// (cork.Conn.Hold, Release).
func (d *Dialer) DialHeld(ctx context.Context) (*amqp.Connection, *cork.Conn, error) {
	urls := d.Addrs.urls
	if len(urls) == 0 {
		return nil, nil, errors.New("dial broker: no broker URL")
	}
	order := d.order(len(urls))
	failed := &Error{}
	for _, i := range order {
		conn, held, err := d.dialOne(ctx, urls[i])
		if err == nil {
			return conn, held, nil
		}
		failed.Attempts = append(failed.Attempts, Attempt{Addr: redact.URL(urls[i]), Err: err})
		if ctx.Err() != nil || Refused(err) {
			break
		}
	}
	return nil, nil, failed
}

func (d *Dialer) order(n int) []int {
	if d.shuffle != nil {
		return d.shuffle(n)
	}
	return rand.Perm(n)
}

// dialOne opens a connection to url, bounded by d.Timeout and ctx, over a
// cork.Conn (under TLS, if any).
func (d *Dialer) dialOne(ctx context.Context, url string) (*amqp.Connection, *cork.Conn, error) {
	var ac amqp.Config
	if d.Config != nil {
		ac = *d.Config
	}
	// A copy, so that the caller's properties keep their own name.
	props := amqp.NewConnectionProperties()
	maps.Copy(props, ac.Properties)
	if d.Name != "" {
		props.SetClientConnectionName(d.Name)
	}
	ac.Properties = props
	if ac.Heartbeat == 0 {
		ac.Heartbeat = DefaultHeartbeat
	}
	timeout := d.Timeout
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	var stop func() bool
	if ac.Dial == nil {
		ac.Dial = func(network, addr string) (net.Conn, error) {
			nd := net.Dialer{Timeout: timeout}
			conn, err := nd.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			// The handshakes' deadline; amqp091-go clears it once open.
			deadline := time.Now().Add(timeout)
			if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
				deadline = dl
			}
			if err := conn.SetDeadline(deadline); err != nil {
				_ = conn.Close()
				return nil, err
			}
			stop = context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
			return conn, nil
		}
	}
	var held *cork.Conn
	dial := ac.Dial
	ac.Dial = func(network, addr string) (net.Conn, error) {
		conn, err := dial(network, addr)
		if err != nil {
			return nil, err
		}
		held = cork.New(conn)
		return held, nil
	}
	conn, err := amqp.DialConfig(url, ac)
	if stop != nil {
		stop()
	}
	if err != nil {
		if ctx.Err() != nil {
			return nil, nil, context.Cause(ctx)
		}
		return nil, nil, err
	}
	return conn, held, nil
}

// Refused reports whether err is the broker's refusal of what a connection
// is configured with: credentials or permissions (403 ACCESS_REFUSED), a
// vhost (530 NOT_ALLOWED). Retrying, on this node or another, does not
// change it.
func Refused(err error) bool {
	var ae *amqp.Error
	return errors.As(err, &ae) && (ae.Code == amqp.AccessRefused || ae.Code == amqp.NotAllowed)
}

// Attempt is one address's failure in a pass.
type Attempt struct {
	// Addr is the address, redacted.
	Addr string
	// Err is the client library's error (its text may quote the URL: use
	// Error's text, which is redacted).
	Err error
}

// Error is a pass that opened no connection: each address's failure, in the
// order tried. Its text is redacted; it wraps the client library's errors,
// so that errors.Is(err, amqp.ErrCredentials) and errors.As(err,
// **amqp.Error) hold.
type Error struct {
	Attempts []Attempt
}

// Error returns "dial broker ADDR: CAUSE", one such part per address tried,
// separated by "; ".
func (e *Error) Error() string {
	parts := make([]string, len(e.Attempts))
	for i, a := range e.Attempts {
		parts[i] = fmt.Sprintf("dial broker %s: %s", a.Addr, redact.Error(a.Err))
	}
	return strings.Join(parts, "; ")
}

// Unwrap returns each address's error.
func (e *Error) Unwrap() []error {
	errs := make([]error, len(e.Attempts))
	for i, a := range e.Attempts {
		errs[i] = a.Err
	}
	return errs
}

// Last returns the error of the last address tried (nil when none was).
func (e *Error) Last() error {
	if len(e.Attempts) == 0 {
		return nil
	}
	return e.Attempts[len(e.Attempts)-1].Err
}

// DialURL parses url (one AMQP URL or several separated by commas) and
// makes one pass of Dial over it: a connection named name, each attempt
// bounded by timeout (0: DefaultTimeout) and ctx.
func DialURL(ctx context.Context, url, name string, timeout time.Duration) (*amqp.Connection, error) {
	addrs, err := Parse(url)
	if err != nil {
		return nil, err
	}
	d := Dialer{Addrs: addrs, Name: name, Timeout: timeout}
	return d.Dial(ctx)
}
