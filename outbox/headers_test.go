package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
)

// Headers go through the table and the relay unchanged: the consumer gets
// what it gets for the same table published directly, strings with NUL
// bytes and names and values that are not UTF-8 included.
func TestRelayHeadersAsPublishedDirectly(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		return e.ob.Enqueue(ctx, tx, outbox.Message{
			Exchange: e.exchange, RoutingKey: boundKey, MessageID: "relayed", Headers: testamqp.EveryHeaderType(),
		})
	})
	if err != nil {
		t.Fatalf("enqueue: %v", err)
	}
	testamqp.Publish(t, testamqp.Channel(t, e.conn), e.exchange, boundKey, amqp.Publishing{
		MessageId: "direct", Headers: testamqp.EveryHeaderType(),
	})
	e.startRelay(t, e.relayConfig(t))

	_, got := e.consumeAll(t, 2, 20*time.Second)
	headers := map[string]amqp.Table{}
	for _, d := range got {
		headers[d.MessageId] = d.Headers
	}
	relayed := headers["relayed"]
	// The relay adds its publish span's context, and nothing else.
	delete(relayed, "traceparent")
	delete(relayed, "tracestate")
	if diff := testamqp.HeadersDiff(relayed, headers["direct"]); diff != "" {
		t.Fatalf("relayed headers differ from the same headers published directly:%s", diff)
	}
}

// A row written before migration 004, its headers as typed JSON in the old
// column, is published with those headers after the upgrade.
func TestRelayPublishesHeadersWrittenBeforeTheUpgrade(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	ctx := context.Background()
	// A schema at version 3 (before 004), where the old code wrote a row.
	schemaName := testdb.Schema(t, e.pool)
	ident := pgx.Identifier{schemaName}.Sanitize()
	if err := schema.MigrateTo(ctx, e.pool, schemaName, 3); err != nil {
		t.Fatalf("migrate to version 3: %v", err)
	}
	// What the old Enqueue wrote for these headers.
	stored := `{"i64": {"t": "int64", "v": 7}, "b": {"t": "bytes", "v": "eA=="}, "s": {"t": "string", "v": "héllo"},
		"ts": {"t": "timestamp", "v": 1700000000}, "arr": {"t": "array", "v": [{"t": "int32", "v": 1}, {"t": "null"}]},
		"tab": {"t": "table", "v": {"d": {"t": "decimal", "v": {"scale": 2, "value": 5}}}}}`
	_, err := e.pool.Exec(ctx, "INSERT INTO "+ident+".outbox (exchange, routing_key, headers, body, message_id) VALUES ($1, $2, $3, '', 'old')",
		e.exchange, boundKey, stored)
	if err != nil {
		t.Fatalf("insert an old row: %v", err)
	}
	if err := schema.Migrate(ctx, e.pool, schemaName); err != nil {
		t.Fatalf("upgrade: %v", err)
	}

	ob, err := outbox.New(e.pool, &outbox.Config{Schema: schemaName})
	if err != nil {
		t.Fatal(err)
	}
	startRelayOf(t, ob, e.relayConfig(t))
	_, got := e.consumeAll(t, 1, 20*time.Second)
	headers := got[0].Headers
	delete(headers, "traceparent")
	delete(headers, "tracestate")
	want := amqp.Table{
		"i64": int64(7), "b": []byte("x"), "s": "héllo", "ts": time.Unix(1700000000, 0),
		"arr": []any{int32(1), nil}, "tab": amqp.Table{"d": amqp.Decimal{Scale: 2, Value: 5}},
	}
	if diff := testamqp.HeadersDiff(headers, want); diff != "" {
		t.Fatalf("headers of the old row:%s", diff)
	}
}
