package idemqotel_test

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/idemqotel"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/schema"
)

// A worker's telemetry in one call: traces exported as the OTEL_* variables
// say (they continue across retries and the outbox with no propagator to
// set), and /metrics and /healthz on the worker's port.
func Example() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	tel, err := idemqotel.Setup(ctx, idemqotel.Options{
		ServiceName: "payments",
		Addr:        "127.0.0.1:0", // e.g. ":9090"; or mount tel.Handler() on your own server
	})
	if err != nil {
		log.Fatal(err)
	}
	defer tel.Shutdown(context.Background()) //nolint:errcheck

	// The services the tests use (IDEMQ_TEST_*_URL, else the local ones).
	pgURL := cmp.Or(os.Getenv("IDEMQ_TEST_POSTGRES_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	amqpURL := cmp.Or(os.Getenv("IDEMQ_TEST_AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")
	pool, err := pgxpool.New(ctx, pgURL)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	dbSchema, queue := "idemq_example_otel", "example.otel.payments"
	if err := schema.Migrate(ctx, pool, dbSchema); err != nil {
		log.Fatal(err)
	}
	defer pool.Exec(context.Background(), "DROP SCHEMA "+dbSchema+" CASCADE") //nolint:errcheck
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: dbSchema})
	if err != nil {
		log.Fatal(err)
	}

	outcomes := make(chan consumer.Event, 2)
	cfg := &consumer.Config{
		URL: amqpURL, Queue: queue, Name: "charge", RetryInitial: 100 * time.Millisecond,
		TracerProvider: tel.TracerProvider(), MeterProvider: tel.MeterProvider(),
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
		OnOutcome: func(e consumer.Event) { outcomes <- e },
	}
	if err := consumer.Apply(ctx, cfg.URL, cfg.TopologyConfig()); err != nil {
		log.Fatal(err)
	}
	c, err := consumer.New(store, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		if d.Attempt == 1 {
			return consumer.Response{}, errors.New("card network timeout") // retried
		}
		return consumer.Response{Code: 201}, nil
	}, cfg)
	if err != nil {
		log.Fatal(err)
	}
	done := make(chan error)
	go func() { done <- c.Run(ctx) }()

	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		log.Fatal(err)
	}
	defer deleteTopology(ch, c.Topology())
	if err := ch.PublishWithContext(ctx, "", queue, false, false, amqp.Publishing{MessageId: "order-1", Body: []byte(`{}`)}); err != nil {
		log.Fatal(err)
	}
	for range 2 {
		select {
		case e := <-outcomes:
			fmt.Println("attempt", e.Attempt, e.Outcome)
		case <-time.After(30 * time.Second):
			fmt.Println("no outcome within 30s")
		}
	}
	cancel()
	if err := <-done; err != nil {
		log.Fatal(err)
	}

	base := "http://" + tel.MetricsAddr()
	for _, line := range fetch(base + "/metrics") {
		if strings.HasPrefix(line, "idemq_consumer_deliveries_total{") {
			fmt.Println(line[strings.Index(line, "outcome="):])
		}
	}
	fmt.Print("/healthz: ", strings.Join(fetch(base+"/healthz"), ""))
	// Output:
	// attempt 1 retried
	// attempt 2 processed
	// outcome="processed"} 1
	// outcome="retried"} 1
	// /healthz: ok
}

// fetch returns the lines of the body at url, in the order the server wrote them.
func fetch(url string) []string {
	req, err := http.NewRequestWithContext(context.Background(), http.MethodGet, url, nil)
	if err != nil {
		log.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		log.Fatal(err)
	}
	defer resp.Body.Close()
	var lines []string
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	return lines
}

func deleteTopology(ch *amqp.Channel, t consumer.Topology) {
	ch.QueueDelete(t.Queue, false, false, false) //nolint:errcheck
	ch.QueueDelete(t.DLQ, false, false, false)   //nolint:errcheck
	for _, d := range t.Delays {
		ch.QueueDelete(t.TierName(d), false, false, false) //nolint:errcheck
	}
	ch.ExchangeDelete(t.DLX, false, false) //nolint:errcheck
}
