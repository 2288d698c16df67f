package cli

import (
	"errors"
	"reflect"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
)

func TestParseBind(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want consumer.Binding
	}{
		{"orders:order.paid", consumer.Binding{Exchange: "orders", Key: "order.paid"}},
		{"orders:topic:order.*", consumer.Binding{Exchange: "orders", Kind: "topic", Key: "order.*", Declare: true}},
		{"events:fanout:", consumer.Binding{Exchange: "events", Kind: "fanout", Declare: true}},
		{"hash:x-consistent-hash:10", consumer.Binding{Exchange: "hash", Kind: "x-consistent-hash", Key: "10", Declare: true}},
		{"orders:a:b", consumer.Binding{Exchange: "orders", Key: "a:b"}}, // not a kind: a key with a colon
		{"refunds:headers:x-match=any,type=refund", consumer.Binding{Exchange: "refunds", Kind: "headers", Args: amqp.Table{"x-match": "any", "type": "refund"}, Declare: true}},
	} {
		got, err := parseBind("q", tc.in)
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("parseBind(%q) = %+v, %v; want %+v", tc.in, got, err, tc.want)
		}
		if err == nil && got.String() != tc.in && tc.want.Args == nil {
			t.Errorf("%+v prints as %q, want %q", got, got.String(), tc.in)
		}
	}
	for _, bad := range []string{"orders", ":k", "orders::k", "refunds:headers:type", "refunds:headers:=x", "q.dlx:k"} {
		var ue *usageError
		if _, err := parseBind("q", bad); !errors.As(err, &ue) {
			t.Errorf("parseBind(%q): %v, want a usage error", bad, err)
		}
	}
}

func TestTopologyFileDefaults(t *testing.T) {
	d, err := topologyFile{Queues: []fileQueue{{Name: "q"}}}.deployment()
	if err != nil {
		t.Fatal(err)
	}
	if got, want := consumer.NewTopology(d.queues[0]), consumer.NewTopology(consumer.TopologyConfig{Queue: "q"}); !reflect.DeepEqual(got, want) {
		t.Errorf("a bare entry declares %+v, want the defaults %+v", got, want)
	}
	for _, bad := range []fileQueue{
		{Name: "q", Retry: fileRetry{MaxAttempts: -1}},
		{Name: "q", Retry: fileRetry{Initial: 20 * time.Minute}}, // longer than the default max
		{Name: "q", DeliveryLimit: -1},
		{Name: "q", Bindings: []fileBinding{{Exchange: "x", Declare: true}}},
		{Name: "q", Bindings: []fileBinding{{Exchange: "x", Arguments: map[string]any{"k": struct{}{}}}}},
	} {
		if _, err := (topologyFile{Queues: []fileQueue{bad}}).deployment(); err == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
}
