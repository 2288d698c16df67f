package ui

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"path"
	"strings"
	"sync"
	"time"
)

// Cookie names.
const (
	sessionCookie = "idemq_ui_session"
	csrfCookie    = "idemq_ui_csrf"
	// csrfField is the form field that carries the CSRF token.
	csrfField = "csrf"
	// maxForm bounds a form's body.
	maxForm = 1 << 20
)

// Token is a secret that opens the UI, and the name under which what its
// holder changes is recorded (the audit's actor).
type Token struct {
	Name, Secret string
}

// DefaultTokenName is the name of Config.Token.
const DefaultTokenName = "token"

// secrets are what the server checks requests against: the tokens and the
// key CSRF tokens are made with.
type secrets struct {
	tokens  []Token
	csrfKey []byte
}

func newSecrets(tokens []Token) (secrets, error) {
	s := secrets{tokens: tokens, csrfKey: make([]byte, 32)}
	for _, t := range tokens {
		if t.Name == "" || t.Secret == "" {
			return s, errors.New("a token needs a name and a secret")
		}
	}
	if _, err := rand.Read(s.csrfKey); err != nil {
		return s, fmt.Errorf("csrf key: %w", err)
	}
	return s, nil
}

// required reports whether requests must carry a token.
func (s secrets) required() bool { return len(s.tokens) > 0 }

// match returns the name of the token cred is, comparing with every token
// in constant time.
func (s secrets) match(cred string) (string, bool) {
	name := ""
	for _, t := range s.tokens {
		if equal(cred, t.Secret) && name == "" {
			name = t.Name
		}
	}
	return name, name != ""
}

// bearer returns the credentials of r's Authorization header when its
// scheme is Bearer, in any case (RFC 9110, section 11.1).
func bearer(r *http.Request) (string, bool) {
	scheme, cred, _ := strings.Cut(r.Header.Get("Authorization"), " ")
	if !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	return strings.TrimSpace(cred), true
}

// authenticated reports whether r carries a token (bearer) or the cookie
// of a live session; always true when no token is configured.
func (s *Server) authenticated(r *http.Request) bool {
	_, ok := s.who(r)
	return ok
}

// who returns the name of the token r carries (bearer), or that its
// session was opened with, and whether r is authenticated. A bearer token
// decides alone: a wrong one is not saved by a cookie. Without tokens
// configured every request is, under the name "anonymous@" and its
// client's address.
func (s *Server) who(r *http.Request) (string, bool) {
	if !s.secrets.required() {
		host, _, err := net.SplitHostPort(r.RemoteAddr)
		if err != nil {
			host = r.RemoteAddr
		}
		return "anonymous@" + host, true
	}
	if cred, ok := bearer(r); ok {
		return s.secrets.match(cred)
	}
	c, err := r.Cookie(sessionCookie)
	if err != nil {
		return "", false
	}
	return s.sessions.valid(c.Value)
}

func equal(a, b string) bool { return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1 }

// authenticate lets through the login page, the style sheet and requests
// that authenticated; it sends a browser to the login page and refuses the rest.
func (s *Server) authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.authenticated(r) || r.URL.Path == "/login" || strings.HasPrefix(r.URL.Path, "/static/") {
			next.ServeHTTP(w, r)
			return
		}
		// A browser is sent to log in; a script (a bearer token, or any
		// request of the API) is told it is not authorized.
		if _, ok := bearer(r); r.Method == http.MethodGet && !ok && !strings.HasPrefix(r.URL.Path, "/api/") {
			http.Redirect(w, r, "/login?next="+url.QueryEscape(r.URL.RequestURI()), http.StatusSeeOther)
			return
		}
		w.Header().Set("WWW-Authenticate", `Bearer realm="idemq ui"`)
		http.Error(w, "unauthorized: give the token (--auth-token-file) as a bearer token or log in", http.StatusUnauthorized)
	})
}

// csrfToken returns the CSRF token of r's browser, setting its cookie when
// it has none yet. Call it before the response's body is written.
func (s *Server) csrfToken(w http.ResponseWriter, r *http.Request) string {
	nonce := ""
	if c, err := r.Cookie(csrfCookie); err == nil && len(c.Value) == 64 {
		nonce = c.Value
	} else {
		b := make([]byte, 32)
		_, _ = rand.Read(b)
		nonce = hex.EncodeToString(b)
		http.SetCookie(w, &http.Cookie{Name: csrfCookie, Value: nonce, Path: "/", HttpOnly: true,
			Secure: r.TLS != nil, SameSite: http.SameSiteStrictMode})
		// A page rendered in this same request already sees it.
		r.AddCookie(&http.Cookie{Name: csrfCookie, Value: nonce})
	}
	return s.csrfFor(nonce)
}

func (s *Server) csrfFor(nonce string) string {
	m := hmac.New(sha256.New, s.secrets.csrfKey)
	m.Write([]byte(nonce))
	return hex.EncodeToString(m.Sum(nil))
}

var errCSRF = errors.New("missing or invalid CSRF token: reload the page and try again")

// checkCSRF refuses a POST whose form does not carry the token bound to its
// CSRF cookie.
func (s *Server) checkCSRF(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			next.ServeHTTP(w, r)
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, maxForm)
		if err := r.ParseForm(); err != nil {
			s.fail(w, r, http.StatusBadRequest, fmt.Errorf("read form: %w", err))
			return
		}
		c, err := r.Cookie(csrfCookie)
		if err != nil || !equal(r.PostForm.Get(csrfField), s.csrfFor(c.Value)) {
			s.fail(w, r, http.StatusForbidden, errCSRF)
			return
		}
		next.ServeHTTP(w, r)
	})
}

type loginView struct {
	Next   string
	Failed bool
}

func (s *Server) loginPage(w http.ResponseWriter, r *http.Request) {
	if !s.secrets.required() {
		http.Redirect(w, r, "/", http.StatusSeeOther)
		return
	}
	s.render(w, r, http.StatusOK, "login", "Log in", loginView{Next: localPath(r.URL.Query().Get("next"))})
}

func (s *Server) login(w http.ResponseWriter, r *http.Request) {
	next := localPath(r.PostForm.Get("next"))
	if !s.secrets.required() {
		http.Redirect(w, r, next, http.StatusSeeOther)
		return
	}
	name, ok := s.secrets.match(strings.TrimSpace(r.PostForm.Get("token")))
	if !ok {
		s.render(w, r, http.StatusUnauthorized, "login", "Log in", loginView{Next: next, Failed: true})
		return
	}
	// A login is a new session: one the browser had before ends.
	if c, err := r.Cookie(sessionCookie); err == nil {
		s.sessions.end(c.Value)
	}
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: s.sessions.start(name), Path: "/",
		MaxAge: int(sessionLifetime / time.Second), HttpOnly: true, Secure: r.TLS != nil, SameSite: http.SameSiteStrictMode})
	http.Redirect(w, r, next, http.StatusSeeOther)
}

// logout ends the browser's session on the server, so that its cookie, kept
// or copied, opens nothing any more.
func (s *Server) logout(w http.ResponseWriter, r *http.Request) {
	if c, err := r.Cookie(sessionCookie); err == nil {
		s.sessions.end(c.Value)
	}
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: "", Path: "/", MaxAge: -1, HttpOnly: true,
		Secure: r.TLS != nil, SameSite: http.SameSiteStrictMode})
	http.Redirect(w, r, "/login", http.StatusSeeOther)
}

// localPath returns next, cleaned, when it is a path on this server, and
// "/" otherwise: it is the one check of every redirect target the UI is
// given (the login's next).
//
// A browser reads a Location header more loosely than Go does (the WHATWG
// URL parser): it trims C0 controls and spaces around it, removes tabs and
// newlines in it, reads \ as /, and resolves dot segments; "/<TAB>/evil" or
// "/./\evil" become "//evil", another host. So next is refused when it holds
// anything but printable ASCII or a backslash, or is not a path-only
// reference (no scheme, host, user or opaque part); the result is built from
// the cleaned path (one leading slash, no dot segments, a trailing slash
// kept) and the query re-encoded, and checked once more.
func localPath(next string) string {
	for i := 0; i < len(next); i++ {
		if c := next[i]; c <= ' ' || c >= 0x7f || c == '\\' {
			return "/"
		}
	}
	u, err := url.Parse(next)
	if err != nil || u.Scheme != "" || u.Host != "" || u.User != nil || u.Opaque != "" || !strings.HasPrefix(u.Path, "/") {
		return "/"
	}
	p := path.Clean(u.Path)
	if strings.HasSuffix(u.Path, "/") && p != "/" {
		p += "/"
	}
	out := (&url.URL{Path: p, RawQuery: u.Query().Encode()}).String()
	if !strings.HasPrefix(out, "/") || strings.HasPrefix(out, "//") || strings.Contains(out, `\`) {
		return "/"
	}
	return out
}

// Session limits. A session ends at logout, sessionIdle after its last
// request, sessionLifetime after its login, or when the UI stops: sessions
// are held in the server's memory only.
const (
	sessionLifetime = 12 * time.Hour
	sessionIdle     = time.Hour
	// maxSessions bounds the sessions held; a login beyond it ends the oldest.
	maxSessions = 1000
)

// sessions are the logged-in browsers, by the random id of their cookie.
type sessions struct {
	now func() time.Time

	mu   sync.Mutex
	byID map[string]*session
}

type session struct {
	// name is the name of the token the session was opened with.
	name          string
	started, used time.Time
}

func newSessions(now func() time.Time) *sessions {
	return &sessions{now: now, byID: map[string]*session{}}
}

// start begins a session opened with the token named name and returns its
// id: 32 random bytes, hex.
func (ss *sessions) start(name string) string {
	b := make([]byte, 32)
	_, _ = rand.Read(b) // crypto/rand.Read does not fail (Go 1.24)
	id := hex.EncodeToString(b)
	now := ss.now()
	ss.mu.Lock()
	defer ss.mu.Unlock()
	for id, s := range ss.byID {
		if s.expired(now) {
			delete(ss.byID, id)
		}
	}
	for len(ss.byID) >= maxSessions {
		oldest := ""
		for id, s := range ss.byID {
			if oldest == "" || s.started.Before(ss.byID[oldest].started) {
				oldest = id
			}
		}
		delete(ss.byID, oldest)
	}
	ss.byID[id] = &session{name: name, started: now, used: now}
	return id
}

// valid reports whether id is a live session's, with the name of the
// token it was opened with, and counts a use of it.
func (ss *sessions) valid(id string) (string, bool) {
	now := ss.now()
	ss.mu.Lock()
	defer ss.mu.Unlock()
	s, ok := ss.byID[id]
	if !ok {
		return "", false
	}
	if s.expired(now) {
		delete(ss.byID, id)
		return "", false
	}
	s.used = now
	return s.name, true
}

// end ends the session id, if there is one.
func (ss *sessions) end(id string) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	delete(ss.byID, id)
}

func (s *session) expired(now time.Time) bool {
	return now.Sub(s.started) >= sessionLifetime || now.Sub(s.used) >= sessionIdle
}
