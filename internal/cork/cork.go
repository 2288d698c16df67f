// Package cork holds back the writes of a connection while a batch of
// messages is written, and sends them together when the batch is complete:
// one write system call and a few TCP segments for the batch instead of one
// of each per message (amqp091-go flushes every publish). The outbox relay
// holds its connection's writes while it publishes a batch, and releases
// them before it waits for the confirms or for any reply of the broker:
// a request held back would wait for its answer forever.
package cork

import (
	"net"
	"sync"
)

// MaxHeld bounds the bytes held: a write that would go past it sends what is
// held, then itself.
const MaxHeld = 256 << 10

// Conn is a net.Conn whose writes can be held. It is safe for concurrent use.
type Conn struct {
	net.Conn
	mu   sync.Mutex
	held bool
	buf  []byte
}

// New wraps conn.
func New(conn net.Conn) *Conn { return &Conn{Conn: conn} }

// Write sends p, or, while writes are held, keeps it for Release.
func (c *Conn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.held && len(c.buf)+len(p) <= MaxHeld {
		c.buf = append(c.buf, p...)
		return len(p), nil
	}
	if err := c.sendLocked(); err != nil {
		return 0, err
	}
	return c.Conn.Write(p)
}

// Hold keeps the writes from now on until Release.
func (c *Conn) Hold() {
	c.mu.Lock()
	c.held = true
	c.mu.Unlock()
}

// Release sends what is held and stops holding. A failed send closes the
// connection, so that its reader fails too: what was held is lost, as the
// connection is.
func (c *Conn) Release() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.held = false
	return c.sendLocked()
}

func (c *Conn) sendLocked() error {
	if len(c.buf) == 0 {
		return nil
	}
	_, err := c.Conn.Write(c.buf)
	c.buf = c.buf[:0]
	if err != nil {
		_ = c.Conn.Close()
	}
	return err
}
