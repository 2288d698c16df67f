package dlq_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/cmd/idemq/internal/dlq"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/wire"
)

func TestMain(m *testing.M) {
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// setup declares a work queue and its DLQ and fills the DLQ with n dead
// letters, alternating two reasons (both of which a replay may cure).
func setup(t *testing.T, n int) (*amqp.Connection, string) {
	t.Helper()
	q := testamqp.Name(t, "dlqpkg")
	testamqp.DeleteQueuesAtCleanup(t, []string{q, dlq.Name(q)}, nil)
	conn := testamqp.Dial(t)
	ch := testamqp.Channel(t, conn)
	for _, name := range []string{q, dlq.Name(q)} {
		if _, err := ch.QueueDeclare(name, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range n {
		reason := []string{"max_attempts_exceeded", "permanent_error"}[i%2]
		testamqp.Publish(t, ch, "", dlq.Name(q), amqp.Publishing{
			MessageId: fmt.Sprintf("m-%d", i), Body: []byte("x"),
			Headers: amqp.Table{wire.HeaderReason: reason, wire.HeaderAttempt: int32(3)},
		})
	}
	return conn, q
}

func ready(t *testing.T, conn *amqp.Connection, q string) int {
	t.Helper()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return st.Messages
}

func waitReady(t *testing.T, conn *amqp.Connection, q string, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for ready(t, conn, q) != n {
		if time.Now().After(deadline) {
			t.Fatalf("%s: %d ready, want %d", q, ready(t, conn, q), n)
		}
		<-time.After(20 * time.Millisecond) // poll interval
	}
}

func TestListLosesNothing(t *testing.T) {
	t.Parallel()
	conn, q := setup(t, 6)
	ctx := context.Background()
	res, err := dlq.List(ctx, conn, dlq.Name(q), 4, dlq.KeyScope{})
	if err != nil {
		t.Fatal(err)
	}
	if res.InQueue != 6 || len(res.Letters) != 4 || res.ByReason["max_attempts_exceeded"] != 2 || res.Letters[0].MessageID != "m-0" {
		t.Fatalf("list: %+v", res)
	}
	waitReady(t, conn, dlq.Name(q), 6)
	if _, err := dlq.List(ctx, conn, q+".absent", 0, dlq.KeyScope{}); err == nil {
		t.Fatal("listing a missing queue: want an error")
	}
}

func TestReplayStopsAfterTheMessageInHand(t *testing.T) {
	t.Parallel()
	conn, q := setup(t, 6)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	res, err := dlq.Replay(ctx, conn, dlq.ReplayOptions{
		Queue: dlq.Name(q), Target: q, Reason: "max_attempts_exceeded",
		Progress: func(r dlq.ReplayResult) {
			if r.Replayed == 2 {
				cancel() // SIGINT after the second replayed message
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if !res.Interrupted || res.Replayed != 2 || res.Skipped != 1 || res.Read != 3 {
		t.Fatalf("replay: %+v", res)
	}
	waitReady(t, conn, q, 2)
	waitReady(t, conn, dlq.Name(q), 4)

	// The rest, without a filter, with a limit.
	res, err = dlq.Replay(context.Background(), conn, dlq.ReplayOptions{Queue: dlq.Name(q), Target: q, Limit: 3})
	if err != nil || res.Replayed != 3 || res.Interrupted {
		t.Fatalf("replay with limit: %+v, %v", res, err)
	}
	waitReady(t, conn, q, 5)
	waitReady(t, conn, dlq.Name(q), 1)

	ch := testamqp.Channel(t, conn)
	d, ok, err := ch.Get(q, true)
	if err != nil || !ok {
		t.Fatalf("get: %v %v", ok, err)
	}
	// The attempt is left as it was (signed headers must stay intact).
	if d.Headers[wire.HeaderAttempt] != int32(3) || d.Headers[wire.HeaderReason] != nil {
		t.Errorf("replayed headers: %v", d.Headers)
	}

	// A missing target is refused before anything is read.
	if _, err := dlq.Replay(context.Background(), conn, dlq.ReplayOptions{Queue: dlq.Name(q), Target: q + ".absent"}); err == nil {
		t.Fatal("replay to a missing queue: want an error")
	}
	waitReady(t, conn, dlq.Name(q), 1)
}

func TestReplaySelected(t *testing.T) {
	t.Parallel()
	conn, q := setup(t, 4)
	ctx := context.Background()
	n, msgs, err := dlq.Read(ctx, conn, dlq.Name(q), 0, 16)
	if err != nil || n != 4 || len(msgs) != 4 {
		t.Fatalf("read: %d, %d messages, %v", n, len(msgs), err)
	}
	waitReady(t, conn, dlq.Name(q), 4)
	if msgs[1].MessageID != "m-1" || string(msgs[1].Body) != "x" || msgs[1].ID == msgs[2].ID {
		t.Fatalf("read: %+v", msgs)
	}
	want := map[string]bool{msgs[1].ID: true, msgs[3].ID: true}
	pick := func(id string, _ wire.Letter) bool {
		ok := want[id]
		delete(want, id) // each chosen letter once
		return ok
	}
	res, err := dlq.Replay(ctx, conn, dlq.ReplayOptions{Queue: dlq.Name(q), Target: q, Select: pick})
	if err != nil || res.Replayed != 2 || res.Skipped != 2 {
		t.Fatalf("replay: %+v, %v", res, err)
	}
	waitReady(t, conn, q, 2)
	waitReady(t, conn, dlq.Name(q), 2)
	// The same choice again replays nothing: those letters are gone.
	want = map[string]bool{msgs[1].ID: true, msgs[3].ID: true}
	res, err = dlq.Replay(ctx, conn, dlq.ReplayOptions{Queue: dlq.Name(q), Target: q, Select: pick})
	if err != nil || res.Replayed != 0 || res.Skipped != 2 {
		t.Fatalf("second replay: %+v, %v", res, err)
	}
	waitReady(t, conn, dlq.Name(q), 2)
	// The ids are stable across reads.
	_, again, err := dlq.Read(ctx, conn, dlq.Name(q), 0, 0)
	if err != nil || len(again) != 2 || again[0].ID != msgs[0].ID || again[1].ID != msgs[2].ID {
		t.Fatalf("read again: %+v, %v", again, err)
	}
}
