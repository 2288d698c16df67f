package dlq_test

import (
	"bytes"
	"context"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/cmd/idemq/internal/dlq"
	"github.com/idemq/idemq/internal/testamqp"
)

// TestReadKeepsPartOfEachBody: what Read returns holds at most its body
// limit of each body, in slices of their own, and the whole body's size;
// List holds no body at all.
func TestReadKeepsPartOfEachBody(t *testing.T) {
	t.Parallel()
	conn, q := setup(t, 0)
	ch := testamqp.Channel(t, conn)
	body := bytes.Repeat([]byte("b"), 64<<10)
	for range 3 {
		testamqp.Publish(t, ch, "", dlq.Name(q), amqp.Publishing{MessageId: "big", Body: body})
	}
	_, msgs, err := dlq.Read(context.Background(), conn, dlq.Name(q), 0, 100)
	if err != nil || len(msgs) != 3 {
		t.Fatalf("read: %d messages, %v", len(msgs), err)
	}
	for _, m := range msgs {
		if len(m.Body) != 100 || cap(m.Body) > 128 || m.BodySize != len(body) {
			t.Fatalf("kept %d bytes (capacity %d) of a body of %d, want 100 of %d", len(m.Body), cap(m.Body), m.BodySize, len(body))
		}
	}
	waitReady(t, conn, dlq.Name(q), 3)
	_, msgs, err = dlq.Read(context.Background(), conn, dlq.Name(q), 0, 0)
	if err != nil || len(msgs) != 3 || len(msgs[0].Body) != 0 || msgs[0].BodySize != len(body) {
		t.Fatalf("read without bodies: %+v, %v", msgs, err)
	}
}
