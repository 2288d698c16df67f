package publish

import (
	"context"
	"errors"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/amqpdial"
	"github.com/idemq/idemq/internal/confirm"
)

// connect dials one of addrs and opens a confirm session on it. An
// exchange found to exist is trusted for the session's life: a session that
// a missing exchange closed is replaced, and the new one asks again.
func connect(ctx context.Context, addrs amqpdial.Addrs, cfg Config) (*confirm.Session, error) {
	conn, err := dial(ctx, addrs, cfg)
	if err != nil {
		return nil, err
	}
	return confirm.Open(conn, 0)
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

// checkExchange reports, as a final ErrUnroutable, an exchange that does
// not exist.
func checkExchange(s *confirm.Session, exchange string) error {
	err := s.CheckExchange(exchange)
	if errors.Is(err, ErrUnroutable) {
		return &finalError{err}
	}
	return err
}
