package wire_test

import (
	"errors"
	"maps"
	"reflect"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/wire"
)

// The copies of one message, as each writer made it before the wire format
// had one owner (the consumer's retry and dead-letter copies, idemq dlq
// replay's copy, idemq forward's headers), for fixed inputs. The copies made
// now must be the same, byte for byte: messages written then wait in the
// tiers and DLQs of running deployments. One break on purpose: the
// signature is v2, bound to the queue and consumer it is for (the consumer
// "payments" of queue "q"); a v1 signature no longer verifies
// (TestV1SignatureIsNotTrusted, docs/security.md).
var (
	goldenKeys  = wire.Keys{{Secret: []byte("a header key of the golden test")}}.For("q", "payments")
	goldenT0    = time.Date(2026, 11, 30, 12, 0, 0, 123456789, time.UTC)
	traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

	goldenRetry = amqp.Table{
		"traceparent": traceparent, "x-custom": "kept", "x-tenant-id": "acme",
		"x-idemq-attempt":              int32(2),
		"x-idemq-first-seen":           "2026-11-30T12:00:00.123456789Z",
		"x-idemq-original-exchange":    "orders",
		"x-idemq-original-routing-key": "orders.created",
		"x-idemq-tenant":               "acme",
		"x-idemq-signature":            "v2.v31EillH9x22AZSfXXveKFK3LL7UEaVAiWpscjoA1B0",
	}
	goldenDead = amqp.Table{
		"traceparent": traceparent, "x-custom": "kept", "x-tenant-id": "acme",
		"x-idemq-attempt":              int32(1),
		"x-idemq-attempts":             int32(3),
		"x-idemq-error":                "boom",
		"x-idemq-reason":               "max_attempts_exceeded",
		"x-idemq-first-seen":           "2026-11-30T12:00:00.123456789Z",
		"x-idemq-original-exchange":    "orders",
		"x-idemq-original-routing-key": "orders.created",
		"x-idemq-tenant":               "acme",
		"x-idemq-signature":            "v2.WVQFuQiWHsEw-4Pez_i-csdvWCr1U0WTev20-wYaahs",
	}
	goldenReplay = amqp.Table{
		"traceparent": traceparent, "x-custom": "kept", "x-tenant-id": "acme",
		"x-idemq-attempt":              int32(1),
		"x-idemq-first-seen":           "2026-11-30T12:00:00.123456789Z",
		"x-idemq-original-exchange":    "orders",
		"x-idemq-original-routing-key": "orders.created",
		"x-idemq-tenant":               "acme",
		"x-idemq-signature":            "v2.WVQFuQiWHsEw-4Pez_i-csdvWCr1U0WTev20-wYaahs",
	}
	goldenForward = amqp.Table{"x-custom": "kept", "x-tenant-id": "acme"}
)

// published is the publisher's message as the first consumer receives it.
func published() *amqp.Delivery {
	return &amqp.Delivery{
		Exchange: "orders", RoutingKey: "orders.created", MessageId: "op-1", Body: []byte(`{"amount":5}`),
		ContentType: "application/json", CorrelationId: "c-1", UserId: "alice", Expiration: "60000",
		Headers: amqp.Table{"x-custom": "kept", "x-tenant-id": "acme", "traceparent": traceparent},
	}
}

// delivered is p as a consumer of work queue q receives it.
func delivered(p amqp.Publishing, q string) *amqp.Delivery {
	return &amqp.Delivery{
		RoutingKey: q, Headers: p.Headers, ContentType: p.ContentType, ContentEncoding: p.ContentEncoding,
		DeliveryMode: p.DeliveryMode, Priority: p.Priority, CorrelationId: p.CorrelationId, ReplyTo: p.ReplyTo,
		Expiration: p.Expiration, MessageId: p.MessageId, Timestamp: p.Timestamp, Type: p.Type,
		UserId: p.UserId, AppId: p.AppId, Body: p.Body,
	}
}

func with(h amqp.Table, extra amqp.Table) amqp.Table {
	h = maps.Clone(h)
	maps.Copy(h, extra)
	return h
}

// TestCopiesAreByteCompatible compares each copy with the one the earlier
// writers made of the same message.
func TestCopiesAreByteCompatible(t *testing.T) {
	retry := wire.Copy(published(), goldenT0, with(wire.RetryHeaders(2), amqp.Table{wire.HeaderTenant: "acme"}), goldenKeys)
	if diff := testamqp.HeadersDiff(retry.Headers, goldenRetry); diff != "" {
		t.Errorf("retry copy:%s", diff)
	}
	if retry.UserId != "" || retry.Expiration != "" || retry.DeliveryMode != amqp.Persistent ||
		retry.MessageId != "op-1" || retry.CorrelationId != "c-1" || retry.ContentType != "application/json" {
		t.Errorf("retry copy's properties: %+v", retry)
	}
	dl := with(wire.DeadLetterHeaders("max_attempts_exceeded", errors.New("boom"), 3), amqp.Table{wire.HeaderTenant: "acme"})
	dead := wire.Copy(delivered(retry, "q"), goldenT0.Add(time.Minute), dl, goldenKeys)
	if diff := testamqp.HeadersDiff(dead.Headers, goldenDead); diff != "" {
		t.Errorf("dead letter:%s", diff)
	}
	broker := delivered(dead, "q.dlq")
	broker.Headers = with(dead.Headers, amqp.Table{"x-delivery-count": int64(2)})
	broker.UserId, broker.Expiration = "bob", "5000"
	replay := wire.ReplayCopy(broker)
	if diff := testamqp.HeadersDiff(replay.Headers, goldenReplay); diff != "" {
		t.Errorf("replay copy:%s", diff)
	}
	if replay.UserId != "bob" || replay.Expiration != "5000" || replay.MessageId != "op-1" {
		t.Errorf("replay copy's properties: %+v", replay)
	}
	if diff := testamqp.HeadersDiff(wire.ForwardHeaders(replay.Headers), goldenForward); diff != "" {
		t.Errorf("forwarded headers:%s", diff)
	}
}

// TestEveryCopyReadsBack sends the copies of one message through the
// broker, each made from the one before it as it came back (the retry copy,
// its dead letter, the replayed dead letter, the forwarded message), and
// reads each with the readers: the signature, the attempt, the tenant, the
// origin, the key and what a dead letter says.
func TestEveryCopyReadsBack(t *testing.T) {
	t.Parallel()
	conn := testamqp.Dial(t)
	ch := testamqp.Channel(t, conn)
	q, err := ch.QueueDeclare("", false, false, true, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	roundTrip := func(p amqp.Publishing) *amqp.Delivery {
		t.Helper()
		testamqp.Publish(t, ch, "", q.Name, p)
		d, ok, err := ch.Get(q.Name, true)
		if err != nil || !ok {
			t.Fatalf("get: %v, %v", ok, err)
		}
		return &d
	}
	keys := wire.Keys{{Secret: []byte("the header key of this round trip")}}
	tenant := func(d *amqp.Delivery) string { s, _ := wire.String(d.Headers[wire.HeaderTenant]); return s }

	// The consumer's retry copy.
	first := published()
	first.UserId = "" // the test's connection publishes as its own user
	retry := roundTrip(wire.Copy(first, time.Now(), with(wire.RetryHeaders(2), amqp.Table{wire.HeaderTenant: "acme"}), keys))
	if !keys.Verify(retry.Headers, retry.MessageId, retry.Body) {
		t.Fatalf("retry copy does not verify: %v", retry.Headers)
	}
	if ex, rk := wire.Origin(retry); wire.ParseAttempt(retry.Headers) != 2 || tenant(retry) != "acme" || ex != "orders" || rk != "orders.created" {
		t.Errorf("retry copy: attempt %d, tenant %q, origin %q/%q", wire.ParseAttempt(retry.Headers), tenant(retry), ex, rk)
	}

	// The consumer's dead letter of the retry copy.
	dead := roundTrip(wire.Copy(retry, time.Now(), with(wire.DeadLetterHeaders("permanent_error", errors.New("decode: bad"), 2),
		amqp.Table{wire.HeaderTenant: "acme"}), keys))
	l := wire.ReadLetter(dead)
	want := wire.Letter{
		MessageID: "op-1", Reason: "permanent_error", Attempts: 2, Error: "decode: bad",
		FirstSeen: retry.Headers[wire.HeaderFirstSeen].(string), OriginalExchange: "orders", OriginalRoutingKey: "orders.created",
		ContentType: "application/json", BodySize: len(first.Body),
	}
	if !reflect.DeepEqual(l, want) {
		t.Errorf("dead letter reads\n %+v, want\n %+v", l, want)
	}
	if !keys.Verify(dead.Headers, dead.MessageId, dead.Body) || wire.ParseAttempt(dead.Headers) != 1 {
		t.Errorf("dead letter: verifies %v, attempt %d; want true, 1", keys.Verify(dead.Headers, dead.MessageId, dead.Body), wire.ParseAttempt(dead.Headers))
	}

	// idemq dlq replay's copy, made without a key.
	replayed := roundTrip(wire.ReplayCopy(dead))
	if !keys.Verify(replayed.Headers, replayed.MessageId, replayed.Body) {
		t.Fatalf("replayed copy does not verify: %v", replayed.Headers)
	}
	if ex, rk := wire.Origin(replayed); wire.ParseAttempt(replayed.Headers) != 1 || tenant(replayed) != "acme" || ex != "orders" || rk != "orders.created" {
		t.Errorf("replayed copy: attempt %d, tenant %q, origin %q/%q", wire.ParseAttempt(replayed.Headers), tenant(replayed), ex, rk)
	}
	if l := wire.ReadLetter(replayed); l.Reason != wire.ReasonUnknown || l.Error != "" || l.Attempts != 0 {
		t.Errorf("replayed copy still reads as a dead letter: %+v", l)
	}

	// idemq forward's copy: the publisher's headers, none of idemq's.
	forwarded := roundTrip(amqp.Publishing{MessageId: replayed.MessageId, Body: replayed.Body, Headers: wire.ForwardHeaders(replayed.Headers)})
	if diff := testamqp.HeadersDiff(forwarded.Headers, goldenForward); diff != "" {
		t.Errorf("forwarded headers:%s", diff)
	}
	key, kerr := wire.ReadKey(forwarded, "Idempotency-Key")
	ten, terr := wire.ReadTenant(forwarded, "x-tenant-id", false)
	if key != "op-1" || kerr != nil || ten != "acme" || terr != nil || wire.ParseAttempt(forwarded.Headers) != 1 {
		t.Errorf("forwarded: key %q (%v), tenant %q (%v), attempt %d", key, kerr, ten, terr, wire.ParseAttempt(forwarded.Headers))
	}
}
