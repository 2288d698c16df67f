package dedup_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/keystore"
)

func TestValidateKey(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		key  string
		want error
	}{
		{"ordinary", "order-42", nil},
		{"unicode", "заказ-42", nil},
		{"255 bytes", strings.Repeat("k", 255), nil},
		{"empty", "", dedup.ErrKeyRequired},
		{"256 bytes", strings.Repeat("k", 256), dedup.ErrKeyInvalid},
		{"not utf-8", "order-\xff", dedup.ErrKeyInvalid},
		{"newline", "order\n42", dedup.ErrKeyInvalid},
		{"nul", "order\x0042", dedup.ErrKeyInvalid},
		{"c1 control", "order\u008542", dedup.ErrKeyInvalid},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := dedup.ValidateKey(tc.key)
			if !errors.Is(err, tc.want) || (tc.want == nil) != (err == nil) {
				t.Fatalf("ValidateKey = %v, want %v", err, tc.want)
			}
			if err != nil && tc.key != "" && strings.Contains(err.Error(), tc.key) {
				t.Fatalf("error text carries the raw key: %v", err)
			}
		})
	}
}

func TestJSONFieldsFingerprint(t *testing.T) {
	t.Parallel()
	fp := dedup.JSONFieldsFingerprint("amount", "currency", "payer.account")
	same := []string{
		`{"amount":100,"currency":"EUR","payer":{"account":"A"},"note":"x"}`,
		`{"note":"y","payer":{"name":"n","account":"A"},"currency":"EUR","amount":100}`,
		" {\n\t\"amount\" : 100 , \"currency\":\"EUR\",\"payer\":{\"account\":\"A\"}} ",
	}
	first, err := fp([]byte(same[0]))
	if err != nil {
		t.Fatal(err)
	}
	for _, body := range same[1:] {
		got, err := fp([]byte(body))
		if err != nil || got != first {
			t.Fatalf("fingerprint of %s differs (%v)", body, err)
		}
	}
	for _, body := range []string{
		`{"amount":101,"currency":"EUR","payer":{"account":"A"}}`,
		`{"amount":100,"currency":"USD","payer":{"account":"A"}}`,
		`{"amount":100,"currency":"EUR","payer":{"account":"B"}}`,
		`{"amount":"100","currency":"EUR","payer":{"account":"A"}}`,
	} {
		got, err := fp([]byte(body))
		if err != nil || got == first {
			t.Fatalf("fingerprint of %s should differ (%v)", body, err)
		}
	}
	for _, bad := range []string{``, `not json`, `[1,2]`, `{"a":1} {"b":2}`, `"str"`} {
		if _, err := fp([]byte(bad)); !errors.Is(err, dedup.ErrFingerprint) {
			t.Fatalf("fingerprint of %q: %v, want ErrFingerprint", bad, err)
		}
	}
}

func TestDerivedKeyAndKeyHash(t *testing.T) {
	t.Parallel()
	scope := func(tenant, key string) dedup.Scope {
		return dedup.Scope{Consumer: "payments", Tenant: tenant, Key: key}
	}
	a := scope("t1", "order-1").DerivedKey("capture")
	if a != scope("t1", "order-1").DerivedKey("capture") {
		t.Fatal("derived key not deterministic")
	}
	// External systems hold derived keys: their values never change.
	if want := "idemq-ae35756816eec142a15954b96dfb3e441e"; a != want {
		t.Fatalf("derived key %s, want %s", a, want)
	}
	for _, other := range []string{
		scope("t1", "order-1").DerivedKey("refund"),
		scope("t2", "order-1").DerivedKey("capture"),
		scope("t1", "order-2").DerivedKey("capture"),
		scope("t1o", "rder-1").DerivedKey("capture"),
	} {
		if other == a {
			t.Fatalf("derived keys collide: %s", a)
		}
	}
	if len(a) > dedup.MaxKeyLen || dedup.ValidateKey(a) != nil {
		t.Fatalf("derived key %q is not itself a valid key", a)
	}
	if h := scope("", "order-1").KeyHash(); h != "508a7303bc6c" {
		t.Fatalf("key hash %q, want 508a7303bc6c", h)
	}
}

// The tenant rule is the one the consumer applies to a delivery's tenant
// and the HTTP middleware to a request's: a 300-byte tenant is refused by
// both.
func TestValidateTenant(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		tenant string
		ok     bool
	}{
		{"default tenant", "", true},
		{"ordinary", "acme", true},
		{"unicode", "арбуз", true},
		{"255 bytes", strings.Repeat("t", dedup.MaxTenantLen), true},
		{"300 bytes", strings.Repeat("t", 300), false},
		{"not utf-8", "acme-\xff", false},
		{"nul", "acme\x00", false},
		{"tab", "acme\t1", false},
		{"c1 control", "acme\u0085", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := dedup.ValidateTenant(tc.tenant)
			if tc.ok != (err == nil) || (err != nil && !errors.Is(err, dedup.ErrTenantInvalid)) {
				t.Fatalf("ValidateTenant = %v, want ok %v", err, tc.ok)
			}
			if err != nil && tc.tenant != "" && strings.Contains(err.Error(), tc.tenant) {
				t.Fatalf("error text carries the tenant: %v", err)
			}
		})
	}
}

// The store holds every door to the tenant rule: a claim whose tenant breaks
// it reserves nothing, alone or in a batch.
func TestReserveRefusesAnInvalidTenant(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 4, nil)
	ctx := context.Background()
	fp, err := dedup.BodyFingerprint([]byte(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	bad := dedup.Claim{Scope: dedup.Scope{Consumer: "c", Tenant: strings.Repeat("t", 300), Key: "k-1"}, Fingerprint: fp}
	if _, err := store.Reserve(ctx, bad); !errors.Is(err, dedup.ErrTenantInvalid) {
		t.Fatalf("Reserve with a 300-byte tenant: %v, want ErrTenantInvalid", err)
	}
	good := bad
	good.Tenant, good.Key = "acme", "k-2"
	if _, err := keystore.Of(store).ReserveBatch(ctx, []dedup.Claim{good, bad}); !errors.Is(err, dedup.ErrTenantInvalid) {
		t.Fatalf("ReserveBatch with a 300-byte tenant: %v, want ErrTenantInvalid", err)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{store.Config().Schema, "keys"}.Sanitize()).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("%d key rows after refused reservations, want 0", n)
	}
}
