package main_test

import (
	"context"
	"encoding/json"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

// documentedFields returns, for each sentence of docs/cli.md's section
// heading that lists JSON fields ("… the fields `a`, `b`, …"), the names it
// lists, in order.
func documentedFields(t *testing.T, heading string) [][]string {
	t.Helper()
	doc, err := os.ReadFile("../../docs/cli.md")
	if err != nil {
		t.Fatal(err)
	}
	text := string(doc)
	start := strings.Index(text, "\n## "+heading+"\n")
	if start < 0 {
		t.Fatalf("docs/cli.md has no section %q", heading)
	}
	section := text[start+1:]
	if end := strings.Index(section[3:], "\n## "); end >= 0 {
		section = section[:end+3]
	}
	var out [][]string
	for _, m := range regexp.MustCompile("the fields ((?:`[a-z_]+`(?:,\\s+|\\s+and\\s+)?)+)").FindAllStringSubmatch(section, -1) {
		var names []string
		for _, n := range regexp.MustCompile("`([a-z_]+)`").FindAllStringSubmatch(m[1], -1) {
			names = append(names, n[1])
		}
		out = append(out, names)
	}
	if len(out) == 0 {
		t.Fatalf("docs/cli.md, %s: no list of JSON fields", heading)
	}
	return out
}

// sameKeys fails unless object has exactly the keys want.
func sameKeys(t *testing.T, what string, object map[string]any, want []string) {
	t.Helper()
	var got []string
	for k := range object {
		got = append(got, k)
	}
	slices.Sort(got)
	want = slices.Sorted(slices.Values(want))
	if !slices.Equal(got, want) {
		t.Errorf("%s: JSON fields %v, docs/cli.md lists %v", what, got, want)
	}
}

// keys inspect tells a released key (with the reason that released it) from
// one in progress, shows a rejection's reason, prints every documented JSON
// field whatever the row holds, and says where it looked for a missing key.
func TestKeysInspectTellsWhatHappened(t *testing.T) {
	t.Parallel()
	schema := newSchema(t)
	pool := testdb.Pool(t, 4)
	ctx := context.Background()
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	fields := documentedFields(t, "idemq keys inspect")[0]
	reserve := func(key string) *dedup.Lease {
		fp, _ := dedup.BodyFingerprint([]byte("body"))
		res, err := store.Reserve(ctx, dedup.Claim{Scope: dedup.Scope{Consumer: "charge", Tenant: "acme", Key: key}, Fingerprint: fp})
		if err != nil || res.Lease == nil {
			t.Fatalf("reserve %s: %+v, %v", key, res, err)
		}
		return res.Lease
	}
	inspect := func(key string) (text string, js map[string]any) {
		args := []string{"keys", "inspect", "--consumer", "charge", "--tenant", "acme", key}
		text = mustRun(t, env(schema), args...).stdout
		r := mustRun(t, env(schema), append(args, "--json")...)
		if err := json.Unmarshal([]byte(r.stdout), &js); err != nil {
			t.Fatalf("json: %v\n%s", err, r.stdout)
		}
		sameKeys(t, "keys inspect "+key, js, fields)
		return text, js
	}
	contains := func(what, text string, want ...string) {
		t.Helper()
		for _, w := range want {
			if !regexp.MustCompile(w).MatchString(text) {
				t.Errorf("%s: want %q in:\n%s", what, w, text)
			}
		}
	}

	// Held: every field is there, empty ones too.
	reserve("held")
	text, js := inspect("held")
	contains("held", text, `state:\s+in_progress\n`)
	if js["state"] != "in_progress" || js["release_reason"] != "" || js["outcome"] != "" || js["response_code"] != nil {
		t.Errorf("held key: %v", js)
	}

	// Given up on: released, with the reason.
	if err := store.Release(ctx, reserve("given-up"), "max_attempts_exceeded"); err != nil {
		t.Fatal(err)
	}
	text, js = inspect("given-up")
	contains("released", text, `state:\s+released \(max_attempts_exceeded\)\n`, `lease:\s+released at `)
	if js["state"] != "released" || js["release_reason"] != "max_attempts_exceeded" || js["lease_valid"] != false {
		t.Errorf("released key: %v", js)
	}

	// Rejected: the reason with the code and the body.
	l := reserve("rejected")
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return store.Complete(ctx, tx, l, dedup.Result{Outcome: dedup.OutcomeRejected, Code: 402, Reason: "insufficient funds", Response: []byte("no funds")})
	}); err != nil {
		t.Fatal(err)
	}
	text, js = inspect("rejected")
	contains("rejected", text, `state:\s+completed\n`, `outcome:\s+rejected: insufficient funds\n`, `response:\s+code 402, 8 bytes\n`)
	if js["outcome"] != "rejected" || js["response_reason"] != "insufficient funds" || js["response_code"] != 402.0 {
		t.Errorf("rejected key: %v", js)
	}

	// Not found: where it looked.
	r := idemq(t, env(schema), "keys", "inspect", "--consumer", "charge", "--tenant", "acme", "absent")
	if r.code != 1 || !strings.Contains(r.stderr, `key not found (consumer "charge", tenant "acme")`) {
		t.Errorf("absent key: %s", r)
	}
	r = idemq(t, env(schema), "keys", "inspect", "--consumer", "refund", "absent")
	if r.code != 1 || !strings.Contains(r.stderr, `key not found (consumer "refund", default tenant)`) {
		t.Errorf("absent key, default tenant: %s", r)
	}
}

// dlq list --json has every documented field, for a dead letter that
// carries none of idemq's headers too.
func TestDLQListJSONHasEveryDocumentedField(t *testing.T) {
	t.Parallel()
	q := testamqp.Name(t, "jsonq")
	deleteTopologyAtCleanup(t, q, []string{"500ms", "1s"}, nil, nil)
	environ := env(newSchema(t))
	mustRun(t, environ, "topology", "apply", "--queue", q, "--max-attempts", "3", "--retry-initial", "500ms", "--retry-multiplier", "2")
	conn := testamqp.Dial(t)
	ch := testamqp.Channel(t, conn)
	// Confirmed: in the queue for the basic.get of dlq list.
	testamqp.Publish(t, ch, "", q+".dlq", amqp.Publishing{MessageId: "bare", Body: []byte("x")})
	r := mustRun(t, environ, "dlq", "list", "--queue", q, "--json")
	var got map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
		t.Fatalf("json: %v\n%s", err, r.stdout)
	}
	lists := documentedFields(t, "idemq dlq list")
	if len(lists) != 2 {
		t.Fatalf("docs/cli.md, dlq list: %d lists of JSON fields, want the result's and a letter's", len(lists))
	}
	sameKeys(t, "dlq list", got, lists[0])
	letters, _ := got["letters"].([]any)
	if len(letters) != 1 {
		t.Fatalf("letters: %s", r.stdout)
	}
	letter, _ := letters[0].(map[string]any)
	sameKeys(t, "dlq list letter", letter, lists[1])
}

// TestDLQListShowsNoRawKey: dlq list, in text and JSON, shows each dead
// letter's key as its hash in --consumer's scope (the key_hash of that
// consumer's logs), never the raw key (message_id), unless --show-keys.
func TestDLQListShowsNoRawKey(t *testing.T) {
	t.Parallel()
	q := testamqp.Name(t, "rawq")
	deleteTopologyAtCleanup(t, q, []string{"500ms", "1s"}, nil, nil)
	environ := env(newSchema(t))
	mustRun(t, environ, "topology", "apply", "--queue", q, "--max-attempts", "3", "--retry-initial", "500ms", "--retry-multiplier", "2")
	ch := testamqp.Channel(t, testamqp.Dial(t))
	const key = "order-secret-4711"
	testamqp.Publish(t, ch, "", q+".dlq", amqp.Publishing{MessageId: key, Headers: amqp.Table{"x-tenant-id": "acme"}, Body: []byte("x")})
	hash := dedup.Scope{Consumer: "payments", Tenant: "acme", Key: key}.KeyHash()

	r := mustRun(t, environ, "dlq", "list", "--queue", q, "--consumer", "payments")
	if strings.Contains(r.stdout+r.stderr, key) || !strings.Contains(r.stdout, "KEY_HASH") || !strings.Contains(r.stdout, hash) {
		t.Errorf("dlq list: want the key hash %s, not the key: %s", hash, r)
	}
	r = mustRun(t, environ, "dlq", "list", "--queue", q, "--consumer", "payments", "--json")
	var list struct {
		Letters []struct {
			MessageID string `json:"message_id"`
			KeyHash   string `json:"key_hash"`
		} `json:"letters"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &list); err != nil {
		t.Fatalf("json: %v\n%s", err, r.stdout)
	}
	if len(list.Letters) != 1 || list.Letters[0].MessageID != "" || list.Letters[0].KeyHash != hash || strings.Contains(r.stdout, key) {
		t.Errorf("dlq list --json: want message_id \"\" and key_hash %s: %s", hash, r)
	}
	r = mustRun(t, environ, "dlq", "list", "--queue", q, "--consumer", "payments", "--show-keys")
	if !strings.Contains(r.stdout, key) || !strings.Contains(r.stdout, hash) {
		t.Errorf("dlq list --show-keys: want the key and its hash: %s", r)
	}
}
