package consumertest

import (
	"cmp"
	"context"
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/dedup"
)

// The scenarios run without a crash: a second copy of each delivery
// arrives at a second worker while, or after, the first copy is handled.
// Their deliveries go in waves: in ModeSingle one delivery at a time, in
// the group modes all at once, so that the first copies form one group.

// waves are the deliveries in the waves of a scenario.
func (k *pointRun) waves() [][]amqp.Publishing {
	if !k.mode.Single() {
		return [][]amqp.Publishing{k.deliveries}
	}
	var ws [][]amqp.Publishing
	for _, msg := range k.deliveries {
		ws = append(ws, []amqp.Publishing{msg})
	}
	return ws
}

// publishFirst publishes the first copies of a wave, held by h, and keeps
// their traces for the report.
func (k *pointRun) publishFirst(wave []amqp.Publishing, h *hold) ([]string, error) {
	var ids []string
	for _, msg := range wave {
		id, tid, err := k.publish(msg)
		if err != nil {
			return nil, err
		}
		h.copies[id] = true
		ids = append(ids, id)
		k.mu.Lock()
		k.row.TraceIDs = append(k.row.TraceIDs, tid)
		k.mu.Unlock()
	}
	return ids, nil
}

// publishSecond publishes the second copies of a wave, signalled by s.
func (k *pointRun) publishSecond(wave []amqp.Publishing, s *signal) ([]string, error) {
	var ids []string
	for _, msg := range wave {
		id, _, err := k.publish(msg)
		if err != nil {
			return nil, err
		}
		s.copies[id] = true
		ids = append(ids, id)
	}
	return ids, nil
}

// holdFirst starts a worker that takes a wave's first copies (its
// prefetch is the wave: it takes no more) and holds the first handler call
// once it returned. It returns once the call is held, or every copy
// published has ended without it (a key that is invalid, a handler never
// called).
func (k *pointRun) holdFirst(wave []amqp.Publishing, noHeartbeat bool) (*worker, *hold, error) {
	h := newHold()
	ids, err := k.publishFirst(wave, h)
	if err != nil {
		return nil, nil, err
	}
	a, err := k.start(workerOpts{hold: h, prefetch: len(wave), noHeartbeat: noHeartbeat})
	if err != nil {
		return nil, nil, err
	}
	err = k.waitFor(a, "the first copy's handler to return", func() bool { return h.isHeld() || k.allEnded(ids) })
	if err != nil {
		a.stop() //nolint:errcheck // the wait's error is the one to report
		return nil, nil, err
	}
	if h.isHeld() {
		k.mu.Lock()
		k.row.Reached = true
		k.mu.Unlock()
	}
	return a, h, nil
}

// stopBoth frees the held call and stops both workers.
func stopBoth(h *hold, a, b *worker) error {
	h.free()
	var errs []error
	for _, w := range []*worker{b, a} {
		if w != nil {
			errs = append(errs, w.stop())
		}
	}
	return errors.Join(errs...)
}

// duplicateDuring: while the first copies' handler is held, their second
// copies arrive at a second worker (and find their keys busy); then the
// first goes on, and every copy runs to its end.
func duplicateDuring(k *pointRun) error { return k.secondDuringFirst(false) }

// leaseExpired holds the first copies' handler, on a worker without a
// heartbeat, until their leases expired; then their second copies arrive
// at a second worker, which takes the keys over and enters its handler;
// then the first goes on (its completion finds the lease lost), and every
// copy runs to its end.
func leaseExpired(k *pointRun) error { return k.secondDuringFirst(true) }

// secondDuringFirst runs each wave: its first copies held (and their
// leases left to expire, with leaseExpires), its second copies at a second
// worker, then both workers stopped and the copies taken to their end.
func (k *pointRun) secondDuringFirst(leaseExpires bool) error {
	for _, wave := range k.waves() {
		a, h, err := k.holdFirst(wave, leaseExpires)
		if err != nil {
			return err
		}
		b, err := k.second(wave, h, leaseExpires)
		if serr := stopBoth(h, a, b); err == nil {
			err = serr
		}
		if err != nil {
			return err
		}
		if err := k.toEnd(); err != nil {
			return err
		}
	}
	return nil
}

// second publishes a wave's second copies while h holds the first and
// starts a worker for them; it returns once each found its key busy or,
// with leaseExpires (it waits for the held key's lease to expire first),
// once one took its key over and entered the handler. It does nothing when
// h held nothing.
func (k *pointRun) second(wave []amqp.Publishing, h *hold, leaseExpires bool) (*worker, error) {
	if !h.isHeld() {
		return nil, nil
	}
	if leaseExpires {
		if err := k.leaseEnds(h); err != nil {
			return nil, err
		}
	}
	entered := newSignal()
	ids, err := k.publishSecond(wave, entered)
	if err != nil {
		return nil, err
	}
	b, err := k.start(workerOpts{enter: entered})
	if err != nil {
		return nil, err
	}
	// A copy that is not the same operation (another key) may just end; one
	// whose key the held transaction reserved waits for it.
	what, cond := "the second copies to find their keys busy", func() bool { return k.allSeen(ids) || k.blocks(h.tx.pid) }
	if leaseExpires {
		what, cond = "a second copy to take the key over", func() bool {
			select {
			case <-entered.c:
				return true
			default:
				return k.allEnded(ids)
			}
		}
	}
	return b, k.waitFor(b, what, cond)
}

// duplicateAfter delivers every message to its end, then a second copy of
// each.
func duplicateAfter(k *pointRun) error {
	k.mu.Lock()
	k.row.Reached = true
	k.mu.Unlock()
	if _, err := k.publishFirst(k.deliveries, newHold()); err != nil {
		return err
	}
	if err := k.toEnd(); err != nil {
		return err
	}
	if err := k.publishAll(); err != nil {
		return err
	}
	return k.toEnd()
}

// leaseEnds waits until no one holds the key of h's held call: its lease
// expired or was released, or the key completed; or, where the held
// transaction reserved it (the row is not to be seen), that transaction
// ended.
func (k *pointRun) leaseEnds(h *hold) error {
	var ierr error
	err := k.waitFor(nil, "the held key's lease to expire", func() bool {
		rec, err := k.subject.Store.Inspect(context.Background(), h.scope)
		switch {
		case errors.Is(err, dedup.ErrNotFound):
			alive, err := h.tx.open(context.Background(), k.subject.Store.Pool())
			if err = cmp.Or(h.txErr, err); err != nil {
				ierr = fmt.Errorf("look for the held transaction: %w", err)
				return true
			}
			return !alive
		case err != nil:
			ierr = fmt.Errorf("inspect the key: %w", err)
			return true
		}
		return rec.State != dedup.StateInProgress || !rec.LeaseValid
	})
	if ierr != nil {
		return ierr
	}
	return err
}

// blocks reports whether the backend pid holds a lock another one waits
// for: a second copy's reservation waits for the held transaction that
// reserved its key.
func (k *pointRun) blocks(pid uint32) bool {
	var n int
	err := k.subject.Store.Pool().QueryRow(context.Background(),
		"SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid))", int64(pid)).Scan(&n)
	return err == nil && n > 0
}
