package ui_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/idemq/idemq/cmd/idemq/internal/ui"
)

// getWithHost sends GET path to the test server with the Host header host
// (the name a browser puts there: the one in its address bar).
func (e *env) getWithHost(host, path string) page {
	e.t.Helper()
	req, err := http.NewRequest(http.MethodGet, e.srv.URL+path, nil)
	if err != nil {
		e.t.Fatal(err)
	}
	req.Host = host
	return e.do(req)
}

// port is the test server's port.
func (e *env) port() string {
	e.t.Helper()
	u := mustURL(e.t, e.srv.URL)
	return u.Port()
}

// A page whose name an attacker rebinds to 127.0.0.1 is same-origin with
// the UI in the victim's browser; its requests still carry the attacker's
// name in Host, and get 421 before anything is read: pages, the style
// sheet, the login page, a replay.
func TestRebindingHostRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	e.deadLetter("order-77", "permanent_error", "card declined", []byte(`{"amount":100}`))
	e.waitReady(e.topo.DLQ, 1)
	q := url.QueryEscape(e.topo.Queue)
	rebound := "rebind.attacker.example:" + e.port()
	for _, path := range []string{"/", "/dlq?queue=" + q, "/outbox", "/keys?consumer=payments&key=order-77", "/static/style.css", "/login"} {
		p := e.getWithHost(rebound, path)
		if p.code != http.StatusMisdirectedRequest {
			t.Fatalf("GET %s with Host %s: %d, want 421\n%s", path, rebound, p.code, p.body)
		}
		mustNotContain(t, p, "card declined", e.topo.Queue, "permanent_error", "csrf")
	}
	// A replay from the rebound page is refused too, its letter untouched.
	req, err := http.NewRequest(http.MethodPost, e.srv.URL+"/dlq/replay", strings.NewReader(url.Values{"queue": {e.topo.Queue}, "reason": {"permanent_error"}, "count": {"1"}}.Encode()))
	if err != nil {
		t.Fatal(err)
	}
	req.Host = rebound
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	if p := e.do(req); p.code != http.StatusMisdirectedRequest {
		t.Fatalf("POST /dlq/replay with Host %s: %d, want 421", rebound, p.code)
	}
	e.waitReady(e.topo.DLQ, 1)

	// The names the UI is opened at work.
	for _, host := range []string{"127.0.0.1:" + e.port(), "localhost:" + e.port(), "LOCALHOST:" + e.port()} {
		if p := e.getWithHost(host, "/dlq?queue="+q); p.code != http.StatusOK || !strings.Contains(p.body, "card declined") {
			t.Fatalf("GET /dlq with Host %s: %d\n%s", host, p.code, p.body)
		}
		if p := e.getWithHost(host, "/static/style.css"); p.code != http.StatusOK {
			t.Fatalf("GET /static/style.css with Host %s: %d", host, p.code)
		}
	}
}

// login logs the client in with the token and returns its session cookie.
func (e *env) login() *http.Cookie {
	e.t.Helper()
	csrf := field(e.t, csrfInput, e.get("/login").body)
	if p := e.post("/login", url.Values{"csrf": {csrf}, "token": {token}, "next": {"/"}}); p.code != http.StatusSeeOther {
		e.t.Fatalf("login: %d\n%s", p.code, p.body)
	}
	for _, c := range e.client.Jar.Cookies(mustURL(e.t, e.srv.URL)) {
		if c.Name == "idemq_ui_session" {
			return c
		}
	}
	e.t.Fatal("login set no session cookie")
	return nil
}

// getWithCookie sends GET path to base with only the cookie c: what a
// browser (or a thief) that kept the cookie sends.
func getWithCookie(t *testing.T, base, path string, c *http.Cookie) page {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, base+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.AddCookie(&http.Cookie{Name: c.Name, Value: c.Value})
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	return page{code: resp.StatusCode, location: resp.Header.Get("Location")}
}

func refused(p page) bool {
	return p.code == http.StatusUnauthorized || (p.code == http.StatusSeeOther && strings.HasPrefix(p.location, "/login"))
}

// Logging out ends the session on the server: the cookie kept from before
// is refused after.
func TestLogoutEndsTheSession(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *ui.Config) { c.Token = token })
	kept := e.login()
	if p := getWithCookie(t, e.srv.URL, "/outbox", kept); p.code != http.StatusOK {
		t.Fatalf("with the session cookie: %d %q", p.code, p.location)
	}
	if p := e.post("/logout", url.Values{}); p.code != http.StatusSeeOther {
		t.Fatalf("logout: %d\n%s", p.code, p.body)
	}
	if p := getWithCookie(t, e.srv.URL, "/outbox", kept); !refused(p) {
		t.Fatalf("the cookie kept from before the logout: %d %q, want refused", p.code, p.location)
	}
	// Logging in again makes a new session, not the old one back.
	again := e.login()
	if again.Value == kept.Value {
		t.Fatal("a new login got the session cookie of the old one")
	}
	if p := getWithCookie(t, e.srv.URL, "/outbox", kept); !refused(p) {
		t.Fatalf("the old cookie after a new login: %d %q, want refused", p.code, p.location)
	}
	if p := getWithCookie(t, e.srv.URL, "/outbox", again); p.code != http.StatusOK {
		t.Fatalf("the new session: %d %q", p.code, p.location)
	}
}

// Sessions live in the server's memory: a restarted UI (a new Server with
// the same token) knows none of the old ones.
func TestSessionEndsWithTheServer(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *ui.Config) { c.Token = token })
	kept := e.login()
	if p := getWithCookie(t, e.srv.URL, "/", kept); p.code != http.StatusOK {
		t.Fatalf("with the session cookie: %d %q", p.code, p.location)
	}
	s, err := ui.New(e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	restarted := httptest.NewServer(s)
	t.Cleanup(func() { restarted.Close(); s.Close(t.Context()) })
	if p := getWithCookie(t, restarted.URL, "/", kept); !refused(p) {
		t.Fatalf("the old session's cookie on a restarted UI: %d %q, want refused", p.code, p.location)
	}
}

// The scheme of Authorization is case-insensitive (RFC 9110, 11.1). Another
// scheme (a proxy's Basic) is no token: the browser is sent to the login.
func TestBearerSchemeAnyCase(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *ui.Config) { c.Token = token })
	for value, ok := range map[string]bool{
		"Bearer " + token:    true,
		"bearer " + token:    true,
		"BEARER " + token:    true,
		"bEaReR  " + token:   true,
		"bearer wrong-token": false,
		"Bearer":             false,
		"Basic " + token:     false,
		token:                false,
	} {
		req, err := http.NewRequest(http.MethodGet, e.srv.URL+"/outbox", nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Authorization", value)
		p := e.do(req)
		if ok && p.code != http.StatusOK || !ok && !refused(p) {
			t.Errorf("Authorization: %q: %d %q, want ok %v", value, p.code, p.location, ok)
		}
	}
}

// offSiteShapes are redirect targets that leave the site in some parser:
// Go's, or a browser's (which strips tabs and newlines, reads \ as / and
// resolves dot segments).
var offSiteShapes = []string{
	"//evil.example/", "/\\evil.example/", "\\\\evil.example", "/./\\evil.example/x", "/.\\/evil.example",
	"/\t/evil.example/", "/\n/evil.example", "/\r\n/evil.example", " //evil.example", "/\x00/evil.example",
	"https://evil.example/", "http:/\\evil.example", "javascript:alert(1)", "/../\\evil.example",
	"/a/../..//evil.example", "/%2F/evil.example", "/%5Cevil.example", "/\\/evil.example", "\t//evil.example",
	"/..//evil.example", "/.//evil.example", "///evil.example", "/x?y#//evil.example", "/\x7f/evil.example",
}

// onSite reports why the redirect target loc, resolved against the login
// page by Go and by a browser's rules, would leave the UI's host; nil when
// it stays.
func onSite(loc string) error {
	for i := 0; i < len(loc); i++ {
		if loc[i] <= ' ' || loc[i] >= 0x7f {
			return fmt.Errorf("%q: byte %#x is not printable ASCII", loc, loc[i])
		}
	}
	if !strings.HasPrefix(loc, "/") {
		return fmt.Errorf("%q: not a path", loc)
	}
	base, _ := url.Parse("http://127.0.0.1:8089/login")
	for _, l := range []string{loc, browserRead(loc)} {
		ref, err := url.Parse(l)
		if err != nil {
			return fmt.Errorf("%q: %w", l, err)
		}
		u := base.ResolveReference(ref)
		if u.Scheme != "http" || u.Host != "127.0.0.1:8089" || u.User != nil {
			return fmt.Errorf("%q resolves to %s", l, u)
		}
		// A path of "//x" is a host the next time it is read as a reference.
		if strings.HasPrefix(u.Path, "//") || strings.HasPrefix(u.EscapedPath(), "//") {
			return fmt.Errorf("%q resolves to the path %q", l, u.Path)
		}
	}
	return nil
}

// browserRead is loc as a browser's URL parser (WHATWG) reads it before it
// resolves it: C0 controls and spaces around it trimmed, tabs and newlines
// in it removed, \ read as / (in http and https URLs).
func browserRead(loc string) string {
	loc = strings.TrimFunc(loc, func(r rune) bool { return r <= ' ' })
	loc = strings.Map(func(r rune) rune {
		if r == '\t' || r == '\n' || r == '\r' {
			return -1
		}
		return r
	}, loc)
	return strings.ReplaceAll(loc, `\`, "/")
}

// Whatever next a login carries, it is sent to a page of the UI.
func FuzzLocalPath(f *testing.F) {
	for _, s := range append(offSiteShapes, "", "/", "/outbox", "/dlq?queue=payments&reason=permanent_error", "/keys/", "/a/./b/../c") {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, next string) {
		if err := onSite(ui.LocalPath(next)); err != nil {
			t.Fatalf("localPath(%q) = %q: %v", next, ui.LocalPath(next), err)
		}
	})
}

func TestLocalPath(t *testing.T) {
	t.Parallel()
	for next, want := range map[string]string{
		"/outbox": "/outbox",
		"/":       "/",
		"":        "/",
		"/dlq?queue=payments&reason=permanent_error": "/dlq?queue=payments&reason=permanent_error",
		"/dlq?queue=a%2Fb":                           "/dlq?queue=a%2Fb",
		"/jobs?id=3":                                 "/jobs?id=3",
		"/a/./b/../c":                                "/a/c",
		"/keys/":                                     "/keys/",
		"/outbox#parked":                             "/outbox",
		"//evil.example/":                            "/",
		"/\\evil.example/":                           "/",
		"/./\\evil.example/x":                        "/",
		"/\t/evil.example/":                          "/",
		"https://evil.example/":                      "/",
		"/..//evil.example":                          "/evil.example",
	} {
		if got := ui.LocalPath(next); got != want {
			t.Errorf("localPath(%q) = %q, want %q", next, got, want)
		}
	}
}

// A login sends the browser back to the page it came for, never elsewhere.
func TestLoginRedirectStaysOnSite(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *ui.Config) { c.Token = token })
	csrf := field(t, csrfInput, e.get("/login").body)
	for _, next := range offSiteShapes {
		p := e.post("/login", url.Values{"csrf": {csrf}, "token": {token}, "next": {next}})
		if p.code != http.StatusSeeOther {
			t.Fatalf("login with next %q: %d", next, p.code)
		}
		if err := onSite(p.location); err != nil {
			t.Errorf("login with next %q: Location %v", next, err)
		}
	}
	if p := e.post("/login", url.Values{"csrf": {csrf}, "token": {token}, "next": {"/dlq?queue=q&reason=r"}}); p.location != "/dlq?queue=q&reason=r" {
		t.Fatalf("login with next /dlq?queue=q&reason=r: Location %q", p.location)
	}
}

// The names an operator allows (a proxy's, a DNS name of the host) are
// answered; others still get 421. A server on every interface answers to
// any IP literal, which cannot be rebound.
func TestAllowHosts(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *ui.Config) {
		c.Listen = "0.0.0.0:8089"
		c.AllowHosts = []string{"ui.example.com", "*.corp.example"}
		c.Token = token
	})
	for host, ok := range map[string]bool{
		"ui.example.com": true, "UI.Example.Com.:443": true, "ops.corp.example": true, "10.0.0.5:8089": true, "[2001:db8::1]:8089": true,
		"localhost:8089": true, "corp.example": false, "example.com": false, "rebind.attacker.example": false,
	} {
		p := e.getWithHost(host, "/login")
		if ok && p.code != http.StatusOK || !ok && p.code != http.StatusMisdirectedRequest {
			t.Errorf("GET /login with Host %q: %d, want ok %v", host, p.code, ok)
		}
	}
	for _, allow := range []string{"ui.example.com:8089", "http://ui.example.com", "*.*.example", "a*.example"} {
		cfg := e.cfg
		cfg.AllowHosts = []string{allow}
		if _, err := ui.New(cfg); err == nil {
			t.Errorf("New with AllowHosts %q: no error", allow)
		}
	}
}
