package ui

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"html/template"
	"net/http"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/idemq/idemq/cmd/idemq/internal/dlq"
)

// pageNames are the templates under templates/, each rendered inside base.html.
var pageNames = []string{"overview", "dlq", "letter", "replay_confirm", "job", "keys", "outbox", "unpark_confirm", "audit", "login", "error", "duplicates", "trace"}

var funcs = template.FuncMap{
	"ts": func(t any) string {
		switch v := t.(type) {
		case time.Time:
			if v.IsZero() {
				return "-"
			}
			return v.UTC().Format("2006-01-02 15:04:05Z")
		case *time.Time:
			if v == nil || v.IsZero() {
				return "-"
			}
			return v.UTC().Format("2006-01-02 15:04:05Z")
		}
		return fmt.Sprint(t)
	},
	"ago": func(t time.Time) string { return age(time.Since(t)) },
	"age": age,
	// seen is how long ago something was last seen.
	"seen": func(d time.Duration) string {
		if d < time.Second {
			return "just now"
		}
		return age(d) + " ago"
	},
	// doomed says why a replay of reason's letters would come straight back.
	"doomed": dlq.Doomed,
	"dash":   dash,
	"short": func(s string, n int) string {
		if r := []rune(s); len(r) > n {
			return string(r[:n-1]) + "…"
		}
		return s
	},
	"pct": func(a, b int) int {
		if b <= 0 {
			return 0
		}
		return 100 * a / b
	},
}

// dash is s, or "-" when it is empty.
func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// age is a duration as an operator reads it: 45s, 12m, 3h5m.
func age(d time.Duration) string {
	switch {
	case d <= 0:
		return "-"
	case d < time.Minute:
		return d.Round(time.Second).String()
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%dd%02dh", int(d.Hours())/24, int(d.Hours())%24)
}

func parsePages() (map[string]*template.Template, error) {
	out := map[string]*template.Template{}
	for _, name := range pageNames {
		t, err := template.New("base.html").Funcs(funcs).ParseFS(templateFS, "templates/base.html", "templates/"+name+".html")
		if err != nil {
			return nil, fmt.Errorf("template %s: %w", name, err)
		}
		out[name] = t
	}
	return out, nil
}

// view is what base.html renders around a page.
type view struct {
	Title    string
	CSRF     string
	Queues   []navQueue
	ReadOnly bool
	Auth     bool
	// Refresh, when positive, reloads the page every so many seconds.
	Refresh int
	Page    any
}

// navQueue is a queue in the menu: a link to its dead letters, or for a
// partitioned one to its partitions in the overview (each of which links to
// its own).
type navQueue struct {
	Name        string
	Partitioned bool
}

// render writes page name with data p.
func (s *Server) render(w http.ResponseWriter, r *http.Request, code int, name, title string, p any) {
	s.renderRefresh(w, r, code, name, title, p, 0)
}

func (s *Server) renderRefresh(w http.ResponseWriter, r *http.Request, code int, name, title string, p any, refresh time.Duration) {
	v := view{
		Title: title, CSRF: s.csrfToken(w, r), ReadOnly: s.cfg.ReadOnly,
		Auth: s.secrets.required() && s.authenticated(r), Refresh: int(refresh.Seconds()), Page: p,
	}
	for _, q := range s.shown {
		v.Queues = append(v.Queues, navQueue{Name: q.Topology.Queue, Partitioned: len(q.Topology.Partitions) > 0})
	}
	var buf bytes.Buffer
	if err := s.pages[name].Execute(&buf, v); err != nil {
		s.log.Error("ui: render", "page", name, "err", errText(err))
		http.Error(w, "internal error rendering the page", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(code)
	_, _ = w.Write(buf.Bytes())
}

type errorView struct {
	Code    int
	Message string
}

// fail renders an error page; the error's text is redacted.
func (s *Server) fail(w http.ResponseWriter, r *http.Request, code int, err error) {
	s.render(w, r, code, "error", http.StatusText(code), errorView{Code: code, Message: errText(err)})
}

// idHash is the short hash under which the UI shows a message_id that may be
// a raw key (an outbox row's) when no consumer scope is known.
func idHash(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:6])
}

// content is a body or a stored response as a page shows it: text when it
// is printable UTF-8, else a hex dump; at most limit bytes.
type content struct {
	Text      string
	Hex       bool
	Size      int
	Truncated bool
}

func showContent(b []byte, limit int) content {
	c := content{Size: len(b)}
	if len(b) > limit {
		b, c.Truncated = b[:limit], true
	}
	if c.Truncated {
		b = trimPartialRune(b)
	}
	printable := utf8.Valid(b)
	if printable {
		printable = !strings.ContainsFunc(string(b), func(r rune) bool {
			return unicode.IsControl(r) && r != '\n' && r != '\r' && r != '\t'
		})
	}
	if printable {
		c.Text = string(b)
	} else {
		c.Text, c.Hex = hex.Dump(b), true
	}
	return c
}

// trimPartialRune drops an incomplete rune at the end of b (cut by truncation).
func trimPartialRune(b []byte) []byte {
	for i := 0; i < utf8.UTFMax && len(b) > 0; i++ {
		if utf8.Valid(b) {
			return b
		}
		b = b[:len(b)-1]
	}
	return b
}
