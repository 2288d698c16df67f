package publish

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/confirm"
	"github.com/idemq/idemq/internal/redact"
)

// session is one broker connection with its confirm channel.
type session struct {
	conn *amqp.Connection
	pub  *confirm.Publisher
	ch   *amqp.Channel
	dead chan struct{}
	err  atomic.Pointer[amqp.Error]
	once sync.Once

	// probeMu guards probe and exchanges: probe checks that an exchange
	// exists before the first publish to it (a publish to a missing exchange
	// closes the channel, failing every other publish in flight on it; a
	// failed passive declare closes the probe channel instead).
	probeMu   sync.Mutex
	probe     *amqp.Channel
	exchanges map[string]bool
}

// connect dials url and opens a confirm channel.
func connect(ctx context.Context, url string, cfg Config) (*session, error) {
	conn, err := dial(ctx, url, cfg)
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	var pub *confirm.Publisher
	if err == nil {
		pub, err = confirm.New(ch, conn.Config.FrameSize)
	}
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("open confirm channel: %w", err)
	}
	s := &session{conn: conn, pub: pub, ch: ch, dead: make(chan struct{}), exchanges: map[string]bool{"": true}}
	connClosed := conn.NotifyClose(make(chan *amqp.Error, 1))
	chClosed := ch.NotifyClose(make(chan *amqp.Error, 1))
	go func() {
		// Buffered, and the library sends at most one error on each before
		// closing it, so neither can block it.
		var e *amqp.Error
		select {
		case e = <-connClosed:
		case e = <-chClosed:
		}
		if e != nil {
			s.err.Store(e)
		}
		close(s.dead)
	}()
	return s, nil
}

// dial opens a connection named cfg.ConnectionName, bounded by ctx and
// cfg.DialTimeout (unless cfg.AMQPConfig brings a Dial function of its own).
// Its errors never contain the URL's credentials.
func dial(ctx context.Context, url string, cfg Config) (*amqp.Connection, error) {
	var ac amqp.Config
	if cfg.AMQPConfig != nil {
		ac = *cfg.AMQPConfig
	}
	props := amqp.NewConnectionProperties()
	maps.Copy(props, ac.Properties)
	props.SetClientConnectionName(cfg.ConnectionName)
	ac.Properties = props
	if ac.Heartbeat == 0 {
		ac.Heartbeat = 10 * time.Second
	}
	var stop func() bool
	if ac.Dial == nil {
		ac.Dial = func(network, addr string) (net.Conn, error) {
			d := net.Dialer{Timeout: cfg.DialTimeout}
			conn, err := d.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			// The handshakes' deadline; amqp091-go clears it once open.
			deadline := time.Now().Add(cfg.DialTimeout)
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
	conn, err := amqp.DialConfig(url, ac)
	if stop != nil {
		stop()
	}
	if err == nil {
		return conn, nil
	}
	if ctx.Err() != nil {
		return nil, fmt.Errorf("dial broker: %w", context.Cause(ctx))
	}
	// The text only, redacted: the error may quote the URL.
	out := fmt.Errorf("dial broker: %s", redact.Error(err))
	var amqpErr *amqp.Error
	if errors.As(err, &amqpErr) && amqpErr.Server && amqpErr.Code == amqp.AccessRefused {
		// Refused credentials or vhost: retrying will not fix them.
		return nil, &finalError{out}
	}
	return nil, out
}

// checkExchange reports, as ErrUnroutable, an exchange that does not exist.
// Answers are kept for the session's life; a session closed by a missing
// exchange is replaced, and the new one asks again.
func (s *session) checkExchange(exchange string) error {
	s.probeMu.Lock()
	defer s.probeMu.Unlock()
	if s.exchanges[exchange] {
		return nil
	}
	if s.probe == nil || s.probe.IsClosed() {
		ch, err := s.conn.Channel()
		if err != nil {
			return fmt.Errorf("open channel: %w", err)
		}
		s.probe = ch
	}
	err := s.probe.ExchangeDeclarePassive(exchange, "direct", false, false, false, false, nil)
	if err == nil {
		s.exchanges[exchange] = true
		return nil
	}
	var amqpErr *amqp.Error
	if errors.As(err, &amqpErr) && amqpErr.Code == amqp.NotFound {
		return &finalError{&confirm.ReturnError{Code: amqp.NotFound, Text: amqpErr.Reason}}
	}
	return fmt.Errorf("check exchange %q: %w", exchange, err)
}

func (s *session) alive() bool {
	select {
	case <-s.dead:
		return false
	default:
		return !s.ch.IsClosed()
	}
}

// deathErr is why the session closed (nil when it did not, or the client
// closed it).
func (s *session) deathErr() error {
	if e := s.err.Load(); e != nil {
		return e
	}
	return nil
}

func (s *session) close() {
	s.once.Do(func() {
		s.probeMu.Lock()
		if s.probe != nil {
			_ = s.probe.Close()
		}
		s.probeMu.Unlock()
		_ = s.ch.Close()
		_ = s.conn.Close()
		<-s.dead
	})
}
