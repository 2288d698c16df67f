package consumer

import (
	"context"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/idemq/idemq/internal/ordering"
	"github.com/idemq/idemq/internal/redact"
)

// ownerEvery bounds how often the active consumer of a partition records
// that it is (partition_owners): a new session records at its first
// delivery, then at most once per ownerEvery while deliveries come.
const ownerEvery = 10 * time.Second

// ownerMark records, for one session of a partition's consumer, that this
// worker is the partition's active consumer: single-active-consumer sends
// deliveries to the active one only, so getting one is the proof. The
// write runs beside the delivery loop, never in its way.
type ownerMark struct {
	c     *Consumer
	name  string
	mu    sync.Mutex
	last  time.Time
	busy  bool
	wg    sync.WaitGroup
	ended bool
}

// newOwnerMark returns the session's mark, nil for a consumer that is not
// a partition's.
func (c *Consumer) newOwnerMark() *ownerMark {
	if c.cfg.partitionOf == "" {
		return nil
	}
	host, _ := os.Hostname()
	return &ownerMark{c: c, name: fmt.Sprintf("%s (%s, pid %d)", c.cfg.ConnectionName, host, os.Getpid())}
}

// delivered notes a delivery: it records the owner when it is time.
func (m *ownerMark) delivered() {
	if m == nil {
		return
	}
	now := time.Now()
	m.mu.Lock()
	if m.busy || m.ended || now.Sub(m.last) < ownerEvery {
		m.mu.Unlock()
		return
	}
	m.busy, m.last = true, now
	m.wg.Add(1)
	m.mu.Unlock()
	go func() {
		defer m.wg.Done()
		ctx, cancel := m.c.storeCtx(context.Background())
		defer cancel()
		err := ordering.MarkOwner(ctx, m.c.store.Pool(), m.c.store.Config().Schema, m.c.cfg.Name, m.c.cfg.Queue, m.name)
		if err != nil {
			m.c.log.Debug("could not record the partition's active consumer", "err", redact.Error(err))
		}
		m.mu.Lock()
		m.busy = false
		if err != nil {
			m.last = time.Now().Add(time.Second - ownerEvery) // again in a second
		}
		m.mu.Unlock()
	}()
}

// end waits for a write under way; no other starts.
func (m *ownerMark) end() {
	if m == nil {
		return
	}
	m.mu.Lock()
	m.ended = true
	m.mu.Unlock()
	m.wg.Wait()
}
