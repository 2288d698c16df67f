package idemhttp_test

import (
	"fmt"
	"net/http"
	"testing"

	"github.com/idemq/idemq/dedup/idemhttp"
)

// Key gives the handler the parsed key: k for "k", escapes undone, the
// parameters dropped; "" outside a guarded request.
func TestKeyOfRequest(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{}, nil)
	cfg := idemhttp.Config{Methods: []string{http.MethodPost}}
	cfg.Consumer = "echo"
	mw, err := idemhttp.New(a.store, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := newServer(t, mw.Require(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "key=%s", idemhttp.Key(r))
	})))
	for _, c := range []struct{ header, want string }{
		{`"k"`, "k"},
		{`k`, "k"},
		{`"a\"b\\c d"`, `a"b\c d`},
		{`"p";alg=sha-256;n=1.5;b=?1;s="x";t=:AAA=:`, "p"},
		{`bare;not-a-param`, "bare;not-a-param"},
	} {
		// The same key with the same body: "k" and k are one operation.
		r, err := send(srv.Client(), srv.URL, "POST", "/", c.header, c.want)
		if err != nil {
			t.Fatal(err)
		}
		if r.status != 200 || r.body != "key="+c.want {
			t.Fatalf("header %s: %d %q, want key=%s", c.header, r.status, r.body, c.want)
		}
	}
	r, err := send(srv.Client(), srv.URL, "GET", "/", `"k"`, "")
	if err != nil {
		t.Fatal(err)
	}
	if r.body != "key=" {
		t.Fatalf("unguarded GET: %q, want no key", r.body)
	}
}
