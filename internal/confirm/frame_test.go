package confirm_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/confirm"
	"github.com/idemq/idemq/internal/testamqp"
)

// padTo returns a publishing whose header frame is exactly size bytes.
func padTo(t *testing.T, size int) amqp.Publishing {
	t.Helper()
	msg := amqp.Publishing{MessageId: "m", DeliveryMode: amqp.Persistent, Headers: amqp.Table{"pad": ""}, Body: []byte("b")}
	base, err := confirm.HeaderFrameSize(msg)
	if err != nil {
		t.Fatal(err)
	}
	msg.Headers["pad"] = strings.Repeat("x", size-base)
	if got, _ := confirm.HeaderFrameSize(msg); got != size {
		t.Fatalf("padded header frame is %d bytes, want %d", got, size)
	}
	return msg
}

// At exactly frame_max the broker takes the message; one byte more is
// refused before it is sent (the spec counts the whole frame in frame_max),
// and the connection lives on. Raw publishes (not through the Publisher)
// pin the computation: RabbitMQ itself tolerates the 8 bytes of frame
// overhead on top of frame_max, and closes the connection one byte past
// that.
func TestHeaderFrameAtTheLimit(t *testing.T) {
	conn := testamqp.Dial(t)
	frameMax := conn.Config.FrameSize
	if frameMax <= 0 {
		t.Fatalf("negotiated frame_max %d", frameMax)
	}
	p := newPublisher(t, conn)
	queue := testamqp.Name(t, "frame")
	declare(t, conn, queue, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	if err := p.PublishWait(ctx, "", queue, padTo(t, frameMax)); err != nil {
		t.Fatalf("header frame of exactly frame_max (%d): %v", frameMax, err)
	}
	over := padTo(t, frameMax+1)
	if err := p.PublishWait(ctx, "", queue, over); !errors.Is(err, confirm.ErrTooLarge) {
		t.Fatalf("header frame of frame_max+1: %v, want ErrTooLarge", err)
	}
	if conn.IsClosed() {
		t.Fatal("the connection closed")
	}
	if err := p.PublishWait(ctx, "", queue, amqp.Publishing{Body: []byte("after")}); err != nil {
		t.Fatalf("publish after the refused one: %v", err)
	}
	if got := depth(t, conn, queue); got != 2 {
		t.Fatalf("queue holds %d, want 2", got)
	}

	if !rawPublishSurvives(t, queue, padTo(t, frameMax+8)) {
		t.Error("the broker refused a header frame of frame_max+8: the size computation is off")
	}
	if rawPublishSurvives(t, queue, padTo(t, frameMax+9)) {
		t.Error("the broker took a header frame of frame_max+9: the size computation is off")
	}
}

// rawPublishSurvives publishes msg on a connection of its own, without any
// check, and reports whether the connection is still open once a confirm
// of a later message came back (or the broker closed it for FRAME_ERROR).
func rawPublishSurvives(t *testing.T, queue string, msg amqp.Publishing) bool {
	t.Helper()
	raw := testamqp.Dial(t)
	closed := raw.NotifyClose(make(chan *amqp.Error, 1))
	ch := testamqp.Channel(t, raw)
	_ = ch.Publish("", queue, false, false, msg)
	dc, err := ch.PublishWithDeferredConfirm("", queue, false, false, amqp.Publishing{Body: []byte("probe")})
	if err != nil {
		return false
	}
	select {
	case e := <-closed:
		if e == nil || e.Code != amqp.FrameError {
			t.Fatalf("connection closed with %v, want FRAME_ERROR", e)
		}
		return false
	case <-dc.Done():
		return !raw.IsClosed()
	case <-time.After(30 * time.Second):
		t.Fatal("no confirm and no close within 30s")
		return false
	}
}
