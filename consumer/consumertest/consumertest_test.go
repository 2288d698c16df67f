package consumertest_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/deduptest"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
)

// TestMain fails the package if a test leaves a goroutine running (a
// heartbeat, a pool).
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fixture is a fresh schema with a table of effects, where handlers write.
type fixture struct {
	pool  *pgxpool.Pool
	store *dedup.Store
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	pool := testdb.Pool(t, 8)
	store := deduptest.Store(t, pool, nil)
	f := &fixture{pool: pool, store: store}
	f.exec(t, "CREATE TABLE "+f.table("effects")+" (key text, what text)")
	return f
}

func (f *fixture) table(name string) string {
	return pgx.Identifier{f.store.Config().Schema, name}.Sanitize()
}

func (f *fixture) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	if _, err := f.pool.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// effects lists what committed for key, in order.
func (f *fixture) effects(t *testing.T, key string) []string {
	t.Helper()
	rows, err := f.pool.Query(context.Background(), "SELECT what FROM "+f.table("effects")+" WHERE key = $1 ORDER BY ctid", key)
	if err != nil {
		t.Fatal(err)
	}
	whats, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return whats
}

// effect writes what in tx.
func (f *fixture) effect(ctx context.Context, tx pgx.Tx, key, what string) error {
	_, err := tx.Exec(ctx, "INSERT INTO "+f.table("effects")+" VALUES ($1, $2)", key, what)
	return err
}

func message(key string) amqp.Publishing {
	return amqp.Publishing{MessageId: key, ContentType: "application/json", Body: []byte(`{"amount":4200}`)}
}

func wantOutcome(t *testing.T, res *consumertest.Result, want consumer.Outcome) {
	t.Helper()
	if res.Outcome != want {
		t.Fatalf("outcome %s (reason %q, err %v), want %s", res.Outcome, res.Reason, res.Err, want)
	}
}

// TestStepsResumeAfterAFailedRun: a handler whose second step fails is
// retried; run again, it skips the committed step, passes the same derived
// key to the gateway, and completes; a third run is a duplicate that does
// not reach the handler.
func TestStepsResumeAfterAFailedRun(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	gatewayDown := true
	var gatewayKeys []string
	handle := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		err := d.Step(ctx, "reserve-stock", func(ctx context.Context, tx pgx.Tx) error {
			return f.effect(ctx, tx, d.Key, "stock reserved")
		})
		if err != nil {
			return consumer.Response{}, err
		}
		err = d.Step(ctx, "charge", func(ctx context.Context, tx pgx.Tx) error {
			gatewayKeys = append(gatewayKeys, d.DerivedKey("charge"))
			if gatewayDown {
				return errors.New("gateway unavailable")
			}
			return f.effect(ctx, tx, d.Key, "charged")
		})
		if err != nil {
			return consumer.Response{}, err
		}
		return consumer.Response{Code: 201, Body: []byte("done")}, f.effect(ctx, tx, d.Key, "receipt")
	}
	r := consumertest.NewRunner(f.store, handle, &consumer.Config{Name: "payments", Steps: true})

	first := r.Run(t, message("order-1"))
	wantOutcome(t, first, consumer.OutcomeRetried)
	if !first.Called || first.Attempt != 1 || !first.Acked {
		t.Fatalf("first run: called %v, attempt %d, acked %v", first.Called, first.Attempt, first.Acked)
	}
	if first.Record == nil || first.Record.RecoveryPoint != "reserve-stock" || first.Record.State != dedup.StateInProgress {
		t.Fatalf("after the failed run, record %+v; want in progress at recovery point reserve-stock", first.Record)
	}
	if first.Copy == nil || first.Copy.Exchange != "" || first.Copy.RoutingKey != "consumertest.retry.1s" {
		t.Fatalf("retry copy %+v, want one to consumertest.retry.1s", first.Copy)
	}
	if got := f.effects(t, "order-1"); fmt.Sprint(got) != "[stock reserved]" {
		t.Fatalf("effects after the failed run %q, want the first step's only", got)
	}

	gatewayDown = false
	second := r.Run(t, first.Copy.Publishing) // the retry tier delivers the copy
	wantOutcome(t, second, consumer.OutcomeProcessed)
	if second.Attempt != 2 {
		t.Fatalf("the retry copy ran as attempt %d, want 2", second.Attempt)
	}
	if second.Response.Code != 201 || string(second.Response.Body) != "done" {
		t.Fatalf("stored response %d %q, want 201 done", second.Response.Code, second.Response.Body)
	}
	if got := f.effects(t, "order-1"); fmt.Sprint(got) != "[stock reserved charged receipt]" {
		t.Fatalf("effects %q: the first step must not run again", got)
	}
	want := dedup.Scope{Consumer: "payments", Key: "order-1"}.DerivedKey("charge")
	if len(gatewayKeys) != 2 || gatewayKeys[0] != want || gatewayKeys[1] != want {
		t.Fatalf("gateway keys %q, want %s twice", gatewayKeys, want)
	}

	third := r.Run(t, message("order-1"))
	wantOutcome(t, third, consumer.OutcomeDuplicate)
	if third.Called {
		t.Fatal("the handler ran for a duplicate")
	}
	if third.Response.Code != 201 || string(third.Response.Body) != "done" || third.OriginalTraceID != third.Record.TraceID {
		t.Fatalf("duplicate got %d %q, trace %q; want the stored response and the original's trace %q",
			third.Response.Code, third.Response.Body, third.OriginalTraceID, third.Record.TraceID)
	}
}

// TestRedeliveryResumesAfterTheLastStep: the same message delivered again
// (as after a crash) takes the released key over and skips the step the
// failed run committed.
func TestRedeliveryResumesAfterTheLastStep(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	fail := true
	handle := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		err := d.Step(ctx, "ship", func(ctx context.Context, tx pgx.Tx) error {
			return f.effect(ctx, tx, d.Key, "shipped")
		})
		if err == nil && fail {
			err = errors.New("mail server down")
		}
		return consumer.Response{Code: 200}, err
	}
	wantOutcome(t, consumertest.RunHandler(t, f.store, handle, message("order-9")), consumer.OutcomeRetried)
	fail = false
	res := consumertest.RunHandler(t, f.store, handle, message("order-9"))
	wantOutcome(t, res, consumer.OutcomeProcessed)
	if got := f.effects(t, "order-9"); fmt.Sprint(got) != "[shipped]" || res.Record.Attempts != 2 {
		t.Fatalf("effects %q after %d attempts, want the step once after 2", got, res.Record.Attempts)
	}
}

// TestRejectionIsStoredAndReplayed: a business rejection commits the
// handler's writes with the rejection; a duplicate gets it back.
func TestRejectionIsStoredAndReplayed(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	calls := 0
	handle := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		calls++
		if err := f.effect(ctx, tx, d.Key, "declined"); err != nil {
			return consumer.Response{}, err
		}
		return consumer.Response{}, consumer.Reject(402, "insufficient_funds", []byte(`{"balance":10}`))
	}
	res := consumertest.RunHandler(t, f.store, handle, message("order-2"))
	wantOutcome(t, res, consumer.OutcomeRejected)
	if res.Rejection == nil || res.Rejection.Reason != "insufficient_funds" {
		t.Fatalf("rejection %+v, want reason insufficient_funds", res.Rejection)
	}
	if res.Response.Code != 402 || string(res.Response.Body) != `{"balance":10}` || res.Copy != nil || !res.Acked {
		t.Fatalf("response %d %q, copy %+v, acked %v; want the stored rejection, acked", res.Response.Code, res.Response.Body, res.Copy, res.Acked)
	}
	if got := f.effects(t, "order-2"); len(got) != 1 {
		t.Fatalf("effects %q: a rejection commits the handler's writes", got)
	}
	dup := consumertest.RunHandler(t, f.store, handle, message("order-2"))
	wantOutcome(t, dup, consumer.OutcomeDuplicate)
	if calls != 1 || dup.Response.Code != 402 || dup.Record.Result.Outcome != dedup.OutcomeRejected {
		t.Fatalf("duplicate: %d calls, code %d, stored %+v", calls, dup.Response.Code, dup.Record.Result)
	}
	if res.RejectReason != "insufficient_funds" || dup.RejectReason != "insufficient_funds" || dup.Record.Result.Reason != "insufficient_funds" {
		t.Fatalf("reject reason: event %q, duplicate's %q, stored %q; want insufficient_funds", res.RejectReason, dup.RejectReason, dup.Record.Result.Reason)
	}
}

// TestPermanentErrorIsDeadLettered: the writes roll back, the key is
// released, and the dead letter carries the reason.
func TestPermanentErrorIsDeadLettered(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	handle := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		if err := f.effect(ctx, tx, d.Key, "half done"); err != nil {
			return consumer.Response{}, err
		}
		return consumer.Response{}, consumer.Permanent(errors.New("unknown currency"))
	}
	res := consumertest.RunHandler(t, f.store, handle, message("order-3"))
	wantOutcome(t, res, consumer.OutcomeDeadLettered)
	if res.Reason != consumer.ReasonPermanentError || !consumer.IsPermanent(res.Err) {
		t.Fatalf("reason %q, err %v; want %s and a permanent error", res.Reason, res.Err, consumer.ReasonPermanentError)
	}
	if res.Copy == nil || res.Copy.Exchange != "consumertest.dlx" || res.Copy.Headers[consumer.HeaderReason] != consumer.ReasonPermanentError {
		t.Fatalf("dead letter %+v, want one to consumertest.dlx with its reason", res.Copy)
	}
	if res.Record == nil || !res.Record.Released || res.Record.ReleaseReason != consumer.ReasonPermanentError || res.Record.LeaseValid || res.Response.Code != 0 {
		t.Fatalf("record %+v, response %+v; want the key released by permanent_error, nothing stored", res.Record, res.Response)
	}
	if got := f.effects(t, "order-3"); len(got) != 0 {
		t.Fatalf("effects %q: a permanent error rolls the handler's writes back", got)
	}
}

// TestPanicIsRetried: a panic is an infrastructure failure, with its stack.
func TestPanicIsRetried(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	handle := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		if err := f.effect(ctx, tx, d.Key, "before the panic"); err != nil {
			return consumer.Response{}, err
		}
		panic("nil map")
	}
	res := consumertest.RunHandler(t, f.store, handle, message("order-4"))
	wantOutcome(t, res, consumer.OutcomeRetried)
	var pe *consumer.PanicError
	if !errors.As(res.Err, &pe) || pe.Value != "nil map" || len(pe.Stack) == 0 {
		t.Fatalf("err %v, want a PanicError with the value and the stack", res.Err)
	}
	if got := f.effects(t, "order-4"); len(got) != 0 {
		t.Fatalf("effects %q: a panic rolls the handler's writes back", got)
	}
}

// TestHandlerTimeout: a handler slower than HandlerTimeout sees its context
// end, and the delivery is retried with ErrHandlerTimeout as the cause.
func TestHandlerTimeout(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	handle := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		<-ctx.Done()
		return consumer.Response{}, ctx.Err()
	}
	r := consumertest.NewRunner(f.store, handle, &consumer.Config{HandlerTimeout: 100 * time.Millisecond})
	res := r.Run(t, message("order-5"))
	wantOutcome(t, res, consumer.OutcomeRetried)
	if !errors.Is(res.Err, consumer.ErrHandlerTimeout) {
		t.Fatalf("err %v, want ErrHandlerTimeout", res.Err)
	}
}

// TestMaxAttemptsDeadLetters: retry copies run again with the next attempt
// until MaxAttempts, then the delivery is dead-lettered.
func TestMaxAttemptsDeadLetters(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	var attempts []int
	handle := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		attempts = append(attempts, d.Attempt)
		return consumer.Response{}, errors.New("database of record down")
	}
	r := consumertest.NewRunner(f.store, handle, &consumer.Config{MaxAttempts: 2})
	res := r.Run(t, message("order-6"))
	wantOutcome(t, res, consumer.OutcomeRetried)
	res = r.Run(t, res.Copy.Publishing)
	wantOutcome(t, res, consumer.OutcomeDeadLettered)
	if res.Reason != consumer.ReasonMaxAttemptsExceeded || fmt.Sprint(attempts) != "[1 2]" {
		t.Fatalf("reason %q after attempts %v, want %s after [1 2]", res.Reason, attempts, consumer.ReasonMaxAttemptsExceeded)
	}
}

// TestInvalidKeyNeverReachesTheHandler: a message without a key is
// dead-lettered before any claim.
func TestInvalidKeyNeverReachesTheHandler(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	handle := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		t.Error("the handler ran without a key")
		return consumer.Response{}, nil
	}
	res := consumertest.RunHandler(t, f.store, handle, amqp.Publishing{Body: []byte("{}")})
	wantOutcome(t, res, consumer.OutcomeInvalidKey)
	if res.Called || res.Reason != consumer.ReasonKeyRequired || res.Record != nil || res.Copy == nil {
		t.Fatalf("called %v, reason %q, record %+v, copy %+v", res.Called, res.Reason, res.Record, res.Copy)
	}
}

// TestTenantAndOutboxClaim: the tenant comes from its header, and a
// message the handler enqueues gets the id derived from the claim.
func TestTenantAndOutboxClaim(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	handle := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		return consumer.Response{}, outbox.Enqueue(ctx, tx, outbox.Message{Exchange: "billing", RoutingKey: "charged", Body: d.Body})
	}
	msg := message("order-7")
	msg.Headers = amqp.Table{consumer.DefaultTenantHeader: "acme"}
	res := consumertest.RunHandler(t, f.store, handle, msg)
	wantOutcome(t, res, consumer.OutcomeProcessed)
	if res.Tenant != "acme" || res.Record.Tenant != "acme" {
		t.Fatalf("tenant %q, record's %q; want acme", res.Tenant, res.Record.Tenant)
	}
	var id string
	if err := f.pool.QueryRow(context.Background(), "SELECT message_id FROM "+f.table("outbox")).Scan(&id); err != nil {
		t.Fatal(err)
	}
	scope := dedup.Scope{Consumer: consumertest.DefaultName, Tenant: "acme", Key: "order-7"}
	if want := outbox.MessageID(scope, "", 1); id != want {
		t.Fatalf("outbox message id %s, want %s (derived from the claim)", id, want)
	}
}

// TestReplyCarriesTheStoredResult: with reply_to, the stored result is
// sent there, to the first run and to a duplicate.
func TestReplyCarriesTheStoredResult(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	handle := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		return consumer.Response{Code: 200, Body: []byte("balance: 42")}, nil
	}
	msg := message("order-8")
	msg.ReplyTo, msg.CorrelationId = "amq.rabbitmq.reply-to", "c-1"
	for _, want := range []consumer.Outcome{consumer.OutcomeProcessed, consumer.OutcomeDuplicate} {
		res := consumertest.RunHandler(t, f.store, handle, msg)
		wantOutcome(t, res, want)
		if res.Reply == nil || string(res.Reply.Body) != "balance: 42" || res.Reply.CorrelationId != "c-1" || res.Copy != nil {
			t.Fatalf("%s: reply %+v, copy %+v; want the stored result to reply_to", want, res.Reply, res.Copy)
		}
	}
}

// TestNotMigratedFailsTheTest: a store whose schema has no tables fails
// the test with the reason, instead of reporting an outcome.
func TestNotMigratedFailsTheTest(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, 2)
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: deduptest.SchemaName(t, pool)})
	if err != nil {
		t.Fatal(err)
	}
	handle := func(context.Context, pgx.Tx, *consumer.Delivery) (consumer.Response, error) {
		return consumer.Response{}, nil
	}
	msg := failure(func(tb testing.TB) { consumertest.RunHandler(tb, store, handle, message("k")) })
	if msg == "" {
		t.Fatal("RunHandler on an unmigrated schema did not fail the test")
	}
	t.Log(msg)
}

// TestWaitFor: it returns once the condition holds, and fails the test
// with what it waited for when it does not in time.
func TestWaitFor(t *testing.T) {
	t.Parallel()
	ready := make(chan struct{})
	go close(ready)
	consumertest.WaitFor(t, 10*time.Second, "the channel to close", func() bool {
		select {
		case <-ready:
			return true
		default:
			return false
		}
	})
	msg := failure(func(tb testing.TB) {
		consumertest.WaitFor(tb, 50*time.Millisecond, "the impossible", func() bool { return false })
	})
	if msg != "timed out after 50ms waiting for the impossible" {
		t.Fatalf("failure %q", msg)
	}
}

// failure runs fn with a TB whose Fatalf ends fn, and returns the failure
// message ("" if fn did not fail).
func failure(fn func(tb testing.TB)) string {
	tb := &fatalTB{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn(tb)
	}()
	<-done
	return tb.msg
}

// fatalTB records a Fatalf instead of failing the test. Only the methods
// the kit calls are implemented.
type fatalTB struct {
	testing.TB
	msg string
}

func (tb *fatalTB) Helper()                   {}
func (tb *fatalTB) Log(...any)                {}
func (tb *fatalTB) Logf(string, ...any)       {}
func (tb *fatalTB) Cleanup(func())            {}
func (tb *fatalTB) Fatalf(f string, a ...any) { tb.msg = fmt.Sprintf(f, a...); runtime.Goexit() }
