package confirm

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Session is one broker connection with a channel in confirm mode and its
// Publisher: what a long-lived publisher (the outbox relay, the outbox
// publisher) holds, and replaces once the broker closed it. It also checks
// that an exchange exists before the first publish to it: a publish to a
// missing exchange closes the publishing channel, failing every publish in
// flight on it, while a failed passive declare closes only the probe
// channel it ran on. It is safe for concurrent use.
type Session struct {
	conn *amqp.Connection
	ch   *amqp.Channel
	pub  *Publisher
	dead chan struct{}
	err  atomic.Pointer[amqp.Error]
	once sync.Once

	// probeMu guards probe and known. known holds when each exchange was
	// found, kept for exchangeTTL (0: for the session's life).
	probeMu     sync.Mutex
	probe       *amqp.Channel
	known       map[string]time.Time
	exchangeTTL time.Duration
}

// Open opens a confirm channel on conn and watches both: the session is
// dead once either closes. An exchange found to exist is trusted for
// exchangeTTL (0: for the session's life; a session that a missing
// exchange closed is replaced, and the new one asks again). On failure it
// closes conn.
func Open(conn *amqp.Connection, exchangeTTL time.Duration) (*Session, error) {
	ch, err := conn.Channel()
	var pub *Publisher
	if err == nil {
		pub, err = New(ch, conn.Config.FrameSize)
	}
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("open confirm channel: %w", err)
	}
	s := &Session{conn: conn, ch: ch, pub: pub, dead: make(chan struct{}),
		known: map[string]time.Time{}, exchangeTTL: exchangeTTL}
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

// Publisher is the session's publisher with confirms.
func (s *Session) Publisher() *Publisher { return s.pub }

// Dead is closed once the connection or the channel closed.
func (s *Session) Dead() <-chan struct{} { return s.dead }

// Alive reports whether the session can still publish.
func (s *Session) Alive() bool {
	select {
	case <-s.dead:
		return false
	default:
		return !s.ch.IsClosed()
	}
}

// Err is why the broker closed the session: nil while it is alive, or when
// the client closed it.
func (s *Session) Err() error {
	if e := s.err.Load(); e != nil {
		return e
	}
	return nil
}

// Close closes the probe channel, the confirm channel and the connection,
// and waits until the session is dead. It may be called more than once.
func (s *Session) Close() {
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

// ExchangeKnown reports whether the exchange is known to exist without
// asking the broker: the default exchange, or one found within the
// session's exchange TTL.
func (s *Session) ExchangeKnown(name string) bool {
	if name == "" {
		return true
	}
	s.probeMu.Lock()
	defer s.probeMu.Unlock()
	return s.knownLocked(name)
}

func (s *Session) knownLocked(name string) bool {
	t, ok := s.known[name]
	return ok && (s.exchangeTTL <= 0 || time.Since(t) < s.exchangeTTL)
}

// CheckExchange checks that the exchange exists, asking the broker (a
// passive declare on a probe channel) unless ExchangeKnown. A missing
// exchange is a *ReturnError with code 404 (errors.Is ErrUnroutable):
// nothing sent to it could be routed. Any other error is the broker's or
// the connection's.
func (s *Session) CheckExchange(name string) error {
	if name == "" {
		return nil
	}
	s.probeMu.Lock()
	defer s.probeMu.Unlock()
	if s.knownLocked(name) {
		return nil
	}
	if s.probe == nil || s.probe.IsClosed() {
		ch, err := s.conn.Channel()
		if err != nil {
			return fmt.Errorf("open probe channel: %w", err)
		}
		s.probe = ch
	}
	err := s.probe.ExchangeDeclarePassive(name, amqp.ExchangeDirect, false, false, false, false, nil)
	var ae *amqp.Error
	switch {
	case err == nil:
		s.known[name] = time.Now()
		return nil
	case errors.As(err, &ae) && ae.Code == amqp.NotFound:
		s.probe = nil // closed by the broker
		return &ReturnError{Code: amqp.NotFound, Text: ae.Reason}
	}
	return fmt.Errorf("check exchange %q: %w", name, err)
}
