package hostguard_test

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/idemq/idemq/internal/hostguard"
)

func TestCheck(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		listen string
		allow  []string
		host   string
		ok     bool
	}{
		{"127.0.0.1:8089", nil, "127.0.0.1:8089", true},
		{"127.0.0.1:8089", nil, "localhost:8089", true},
		{"127.0.0.1:8089", nil, "LocalHost.:8089", true},
		{"127.0.0.1:8089", nil, "app.localhost:8089", true},
		{"127.0.0.1:8089", nil, "[::1]:8089", true},
		{"127.0.0.1:8089", nil, "127.0.0.1", true},
		{"127.0.0.1:8089", nil, "rebind.attacker.example:8089", false},
		{"127.0.0.1:8089", nil, "rebind.attacker.example", false},
		{"127.0.0.1:8089", nil, "localhost.attacker.example", false},
		{"127.0.0.1:8089", nil, "", false},
		{"127.0.0.1:8089", nil, "10.0.0.5:8089", false},
		{"localhost:8089", nil, "127.0.0.1:8089", true},
		{"[::1]:8089", nil, "[::1]:8089", true},
		{"10.0.0.5:8089", nil, "10.0.0.5:8089", true},
		{"10.0.0.5:8089", nil, "127.0.0.1:8089", false},
		{":8443", nil, "10.0.0.5:8443", true},
		{"0.0.0.0:8443", nil, "[2001:db8::1]:8443", true},
		{":8443", nil, "gateway.internal:8443", false},
		{":8443", []string{"gateway.internal"}, "Gateway.Internal:8443", true},
		{":8443", []string{"*.svc.cluster.local"}, "gw.ns.svc.cluster.local", true},
		{":8443", []string{"*.svc.cluster.local"}, "svc.cluster.local", false},
		{":8443", []string{"*.svc.cluster.local"}, "evilsvc.cluster.local", false},
		{":8443", []string{"a.example, b.example"}, "b.example", true},
		{"ui.internal:8089", nil, "ui.internal:8089", true},
	} {
		g, err := hostguard.New(tc.listen, tc.allow)
		if err != nil {
			t.Fatalf("New(%q, %q): %v", tc.listen, tc.allow, err)
		}
		if err := g.Check(tc.host); (err == nil) != tc.ok {
			t.Errorf("listen %s allow %q: Check(%q) = %v, want ok=%v", tc.listen, tc.allow, tc.host, err, tc.ok)
		}
	}
}

func TestNewRefusesBadNames(t *testing.T) {
	t.Parallel()
	for _, a := range []string{"http://x.example", "x.example:80", "a*.example", "*.*.example", "*."} {
		if _, err := hostguard.New("127.0.0.1:1", []string{a}); err == nil {
			t.Errorf("New allowed %q", a)
		}
	}
}

func TestHandler(t *testing.T) {
	t.Parallel()
	g, err := hostguard.New("127.0.0.1:8089", nil)
	if err != nil {
		t.Fatal(err)
	}
	h := g.Handler(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusTeapot) }))
	for host, want := range map[string]int{"127.0.0.1:8089": http.StatusTeapot, "rebind.attacker.example:8089": http.StatusMisdirectedRequest} {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.Host = host
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code != want {
			t.Errorf("Host %s: status %d, want %d", host, w.Code, want)
		}
	}
}
