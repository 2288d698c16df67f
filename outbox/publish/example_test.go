package publish_test

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/outbox/publish"
)

// requestRefund is one operation of a service that has no database
// transaction to put an outbox row in: it asks the billing workers to
// refund an order. The key is made once, before the first attempt, and
// Publish sends every attempt with it; a caller that retries the whole
// operation would reuse the returned key.
func requestRefund(ctx context.Context, p *publish.Publisher, queue, order string) (key string, err error) {
	key = publish.NewKey()
	err = p.Publish(ctx, key, publish.Message{
		RoutingKey:  queue, // the default exchange: straight to the queue
		ContentType: "application/json",
		Body:        []byte(`{"order":"` + order + `","action":"refund"}`),
	})
	return key, err
}

// A service publishes an operation without a transaction: Publish returns
// once the broker confirmed the message, retrying lost connections and
// nacks with the same message id; a message no queue takes is an error.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// The broker the tests use (IDEMQ_TEST_AMQP_URL, else the local one).
	url := cmp.Or(os.Getenv("IDEMQ_TEST_AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")
	conn, err := amqp.Dial(url)
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		log.Fatal(err)
	}
	queue := "example.refunds"
	if _, err := ch.QueueDeclare(queue, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		log.Fatal(err)
	}
	defer ch.QueueDelete(queue, false, false, false) //nolint:errcheck

	p, err := publish.New(url, &publish.Config{ConnectionName: "refund-service"})
	if err != nil {
		log.Fatal(err)
	}
	defer p.Close()

	key, err := requestRefund(ctx, p, queue, "o-1")
	if err != nil {
		log.Fatal(err)
	}
	d, ok, err := ch.Get(queue, true)
	if err != nil || !ok {
		log.Fatal("no message in the queue: ", err)
	}
	fmt.Println("message_id is the key:", d.MessageId == key)
	fmt.Println(string(d.Body))

	_, err = requestRefund(ctx, p, "example.no-such-queue", "o-2")
	fmt.Println("unroutable:", errors.Is(err, publish.ErrUnroutable))
	// Output:
	// message_id is the key: true
	// {"order":"o-1","action":"refund"}
	// unroutable: true
}
