package confirm

import (
	"errors"
	"fmt"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// These tests feed the loop the notifications amqp091-go would, in the
// order RabbitMQ sends them, with no broker: the ordering logic alone.

type fakeChannel struct {
	p        *Publisher
	returns  chan amqp.Return
	confirms chan amqp.Confirmation
}

func newFake(t *testing.T) *fakeChannel {
	t.Helper()
	f := &fakeChannel{
		p:        &Publisher{inFlight: map[uint64]*Pending{}, done: make(chan struct{})},
		returns:  make(chan amqp.Return, listenerBuffer),
		confirms: make(chan amqp.Confirmation, listenerBuffer),
	}
	t.Cleanup(func() {
		select {
		case <-f.p.done:
		default:
			close(f.confirms)
			<-f.p.done
		}
	})
	return f
}

func (f *fakeChannel) start() { go f.p.loop(f.returns, f.confirms) }

// publish registers a publish under tag, as Publish does before sending.
func (f *fakeChannel) publish(tag uint64, key, body string) *Pending {
	pd := &Pending{tag: tag, routingKey: key, messageID: "m", body: []byte(body), done: make(chan struct{})}
	f.p.mu.Lock()
	f.p.inFlight[tag] = pd
	f.p.mu.Unlock()
	return pd
}

func (f *fakeChannel) ret(key, body string) {
	f.returns <- amqp.Return{ReplyCode: 312, ReplyText: "NO_ROUTE", RoutingKey: key, MessageId: "m", Body: []byte(body)}
}

func (f *fakeChannel) ack(tag uint64) { f.confirms <- amqp.Confirmation{DeliveryTag: tag, Ack: true} }

func result(t *testing.T, pd *Pending) error {
	t.Helper()
	select {
	case <-pd.Done():
		return pd.Err()
	case <-time.After(5 * time.Second):
		t.Fatalf("publish %d never resolved", pd.tag)
		return nil
	}
}

// A return and the ack of the same message both waiting when the loop
// looks: whichever select picks first, the publish fails. (The old
// publisher read the return outside its lock and lost this race.)
func TestReturnWaitingWithItsAckFailsThePublish(t *testing.T) {
	for i := range 500 {
		f := newFake(t)
		pd := f.publish(1, "q", "body")
		f.ret("q", "body")
		f.ack(1)
		f.start()
		if err := result(t, pd); !errors.Is(err, ErrUnroutable) {
			t.Fatalf("round %d: returned then acked: got %v, want ErrUnroutable", i, err)
		}
	}
}

// The loop already running: return, then ack, as the broker sends them.
func TestReturnThenAckFailsThePublish(t *testing.T) {
	f := newFake(t)
	f.start()
	for tag := uint64(1); tag <= 200; tag++ {
		pd := f.publish(tag, "q", fmt.Sprint(tag))
		f.ret("q", fmt.Sprint(tag))
		f.ack(tag)
		if err := result(t, pd); !errors.Is(err, ErrUnroutable) {
			t.Fatalf("publish %d: got %v, want ErrUnroutable", tag, err)
		}
	}
}

// Interleaved publishes: only the returned one fails, whatever the order of
// the other confirms.
func TestInterleavedPublishesOnlyTheReturnedFails(t *testing.T) {
	f := newFake(t)
	f.start()
	p1 := f.publish(1, "q", "one")
	p2 := f.publish(2, "missing", "two")
	p3 := f.publish(3, "q", "three")
	f.ret("missing", "two")
	f.ack(3)
	f.ack(2)
	f.ack(1)
	if err := result(t, p1); err != nil {
		t.Errorf("publish 1: %v, want nil", err)
	}
	if err := result(t, p2); !errors.Is(err, ErrUnroutable) {
		t.Errorf("publish 2: %v, want ErrUnroutable", err)
	}
	if err := result(t, p3); err != nil {
		t.Errorf("publish 3: %v, want nil", err)
	}
}

// Two unconfirmed publishes that a return cannot tell apart both fail: a
// routable twin retried is a duplicate the key absorbs, a returned one
// counted as durable would be a loss.
func TestIndistinguishableTwinsBothFail(t *testing.T) {
	f := newFake(t)
	f.start()
	p1 := f.publish(1, "q", "same")
	p2 := f.publish(2, "q", "same")
	f.ret("q", "same")
	f.ack(1)
	f.ack(2)
	for _, pd := range []*Pending{p1, p2} {
		if err := result(t, pd); !errors.Is(err, ErrUnroutable) {
			t.Errorf("publish %d: %v, want ErrUnroutable", pd.tag, err)
		}
	}
}

// A confirmed publish is never touched by a later return of the same content.
func TestReturnAfterConfirmLeavesItAlone(t *testing.T) {
	f := newFake(t)
	f.start()
	p1 := f.publish(1, "q", "same")
	f.ack(1)
	if err := result(t, p1); err != nil {
		t.Fatalf("publish 1: %v", err)
	}
	p2 := f.publish(2, "q", "same")
	f.ret("q", "same")
	f.ack(2)
	if err := result(t, p2); !errors.Is(err, ErrUnroutable) {
		t.Errorf("publish 2: %v, want ErrUnroutable", err)
	}
	if err := p1.Err(); err != nil {
		t.Errorf("publish 1 changed after its confirm: %v", err)
	}
}

func TestNackFails(t *testing.T) {
	f := newFake(t)
	f.start()
	pd := f.publish(1, "q", "b")
	f.confirms <- amqp.Confirmation{DeliveryTag: 1, Ack: false}
	if err := result(t, pd); !errors.Is(err, ErrNacked) {
		t.Errorf("got %v, want ErrNacked", err)
	}
}

// A channel that closes fails what is pending with ErrClosed, not as a nack.
func TestCloseFailsPendingAsClosed(t *testing.T) {
	f := newFake(t)
	f.start()
	pd := f.publish(1, "q", "b")
	close(f.confirms)
	if err := result(t, pd); !errors.Is(err, ErrClosed) || errors.Is(err, ErrNacked) {
		t.Errorf("got %v, want ErrClosed", err)
	}
}
