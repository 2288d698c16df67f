package ui

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
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

// secrets are what the server checks requests against: the session cookie's
// value (derived from the token) and the key CSRF tokens are made with.
type secrets struct {
	token   string
	session string
	csrfKey []byte
}

func newSecrets(token string) (secrets, error) {
	s := secrets{token: token, csrfKey: make([]byte, 32)}
	if _, err := rand.Read(s.csrfKey); err != nil {
		return s, fmt.Errorf("csrf key: %w", err)
	}
	if token != "" {
		m := hmac.New(sha256.New, []byte(token))
		m.Write([]byte("idemq ui session"))
		s.session = hex.EncodeToString(m.Sum(nil))
	}
	return s, nil
}

// authenticated reports whether r carries the token (bearer) or the session
// cookie; always true when no token is configured.
func (s *Server) authenticated(r *http.Request) bool {
	if s.secrets.token == "" {
		return true
	}
	if bearer, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok {
		return equal(strings.TrimSpace(bearer), s.secrets.token)
	}
	c, err := r.Cookie(sessionCookie)
	return err == nil && equal(c.Value, s.secrets.session)
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
		if r.Method == http.MethodGet && r.Header.Get("Authorization") == "" {
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
	if s.secrets.token == "" {
		http.Redirect(w, r, "/", http.StatusSeeOther)
		return
	}
	s.render(w, r, http.StatusOK, "login", "Log in", loginView{Next: localPath(r.URL.Query().Get("next"))})
}

func (s *Server) login(w http.ResponseWriter, r *http.Request) {
	next := localPath(r.PostForm.Get("next"))
	if s.secrets.token == "" {
		http.Redirect(w, r, next, http.StatusSeeOther)
		return
	}
	if !equal(strings.TrimSpace(r.PostForm.Get("token")), s.secrets.token) {
		s.render(w, r, http.StatusUnauthorized, "login", "Log in", loginView{Next: next, Failed: true})
		return
	}
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: s.secrets.session, Path: "/", HttpOnly: true,
		Secure: r.TLS != nil, SameSite: http.SameSiteStrictMode})
	http.Redirect(w, r, next, http.StatusSeeOther)
}

func (s *Server) logout(w http.ResponseWriter, r *http.Request) {
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: "", Path: "/", MaxAge: -1, HttpOnly: true,
		Secure: r.TLS != nil, SameSite: http.SameSiteStrictMode})
	http.Redirect(w, r, "/login", http.StatusSeeOther)
}

// localPath keeps a redirect target on this server: a path, not a URL.
func localPath(p string) string {
	if !strings.HasPrefix(p, "/") || strings.HasPrefix(p, "//") || strings.HasPrefix(p, "/\\") {
		return "/"
	}
	return p
}
