package confirm_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/confirm"
	"github.com/idemq/idemq/internal/testamqp"
)

func newPublisher(t *testing.T, conn *amqp.Connection) *confirm.Publisher {
	t.Helper()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("open channel: %v", err)
	}
	t.Cleanup(func() { _ = ch.Close() })
	p, err := confirm.New(ch, conn.Config.FrameSize)
	if err != nil {
		t.Fatalf("new publisher: %v", err)
	}
	return p
}

func declare(t *testing.T, conn *amqp.Connection, name string, args amqp.Table) {
	t.Helper()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("open channel: %v", err)
	}
	defer ch.Close()
	if _, err := ch.QueueDeclare(name, true, false, false, false, args); err != nil {
		t.Fatalf("declare %s: %v", name, err)
	}
	testamqp.DeleteQueuesAtCleanup(t, []string{name}, nil)
}

func depth(t *testing.T, conn *amqp.Connection, name string) int {
	t.Helper()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("open channel: %v", err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
	if err != nil {
		t.Fatalf("inspect %s: %v", name, err)
	}
	return q.Messages
}

// Publishes to a missing queue and to a real one, interleaved from several
// goroutines on one channel: every unroutable one fails, every other one is
// durable. (The old publisher reported ~298-300 of 300 unroutable publishes
// as confirmed.)
func TestUnroutableNeverCountsAsDurable(t *testing.T) {
	conn := testamqp.Dial(t)
	p := newPublisher(t, conn)
	queue := testamqp.Name(t, "confirm")
	missing := testamqp.Name(t, "missing")
	declare(t, conn, queue, amqp.Table{"x-queue-type": "quorum"})

	const workers, each = 6, 100
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var mu sync.Mutex
	var routedOK, routedFailed, lostOK int
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range each {
				target := queue
				if (w+i)%2 == 0 {
					target = missing
				}
				err := p.PublishWait(ctx, "", target, amqp.Publishing{
					MessageId: fmt.Sprintf("%d-%d", w, i), Body: []byte("payload"), DeliveryMode: amqp.Persistent,
				})
				mu.Lock()
				switch {
				case target == missing && err == nil:
					lostOK++
				case target == missing:
					if !errors.Is(err, confirm.ErrUnroutable) {
						t.Errorf("unroutable publish: %v, want ErrUnroutable", err)
					}
				case target == queue && err == nil:
					routedOK++
				default:
					routedFailed++
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if lostOK != 0 {
		t.Errorf("%d publishes to a missing queue reported durable", lostOK)
	}
	if routedFailed != 0 {
		t.Errorf("%d routable publishes failed", routedFailed)
	}
	if got := depth(t, conn, queue); got != routedOK {
		t.Errorf("queue holds %d messages, %d reported durable", got, routedOK)
	}
}

// A queue that refuses more (reject-publish overflow) nacks: the result
// says so.
func TestNackedPublishFails(t *testing.T) {
	conn := testamqp.Dial(t)
	p := newPublisher(t, conn)
	queue := testamqp.Name(t, "full")
	declare(t, conn, queue, amqp.Table{"x-max-length": int32(1), "x-overflow": "reject-publish"})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := p.PublishWait(ctx, "", queue, amqp.Publishing{MessageId: "1", Body: []byte("a")}); err != nil {
		t.Fatalf("first publish: %v", err)
	}
	err := p.PublishWait(ctx, "", queue, amqp.Publishing{MessageId: "2", Body: []byte("b")})
	if !errors.Is(err, confirm.ErrNacked) {
		t.Fatalf("publish to a full queue: %v, want ErrNacked", err)
	}
}

// A publish to a missing exchange makes the broker close the channel: what
// was pending fails as closed (fate unknown), not as a nack, and later
// publishes fail at once.
func TestClosedChannelFailsAsClosed(t *testing.T) {
	conn := testamqp.Dial(t)
	p := newPublisher(t, conn)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := p.PublishWait(ctx, testamqp.Name(t, "no-such-exchange"), "k", amqp.Publishing{Body: []byte("x")})
	if !errors.Is(err, confirm.ErrClosed) || errors.Is(err, confirm.ErrNacked) {
		t.Fatalf("publish to a missing exchange: %v, want ErrClosed", err)
	}
	select {
	case <-p.Closed():
	case <-ctx.Done():
		t.Fatal("publisher did not notice its channel closed")
	}
	if _, err := p.Publish(ctx, "", "q", amqp.Publishing{Body: []byte("y")}); err == nil {
		t.Fatal("publish on a closed publisher succeeded")
	}
}
