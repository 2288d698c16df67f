package publish

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/amqpdial"
	"github.com/idemq/idemq/internal/confirm"
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

// connect dials one of addrs and opens a confirm channel.
func connect(ctx context.Context, addrs amqpdial.Addrs, cfg Config) (*session, error) {
	conn, err := dial(ctx, addrs, cfg)
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

// dial opens a connection named cfg.ConnectionName to the first of addrs
// that answers, each attempt bounded by ctx and cfg.DialTimeout (unless
// cfg.AMQPConfig brings a Dial function of its own). Its errors never
// contain the URLs' credentials.
func dial(ctx context.Context, addrs amqpdial.Addrs, cfg Config) (*amqp.Connection, error) {
	d := amqpdial.Dialer{Addrs: addrs, Name: cfg.ConnectionName, Config: cfg.AMQPConfig, Timeout: cfg.DialTimeout}
	conn, err := d.Dial(ctx)
	if err == nil {
		return conn, nil
	}
	if amqpdial.Refused(err) {
		// Refused credentials or vhost: retrying will not fix them.
		return nil, &finalError{err}
	}
	return nil, err
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
