package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/idemq/idemq/dedup/idemhttp"
)

// The problem codes of the gateway's own refusals, beside idemhttp's.
const (
	// CodeRoutingKeyNotAllowed: the request names a routing key that no
	// pattern of Config.AllowRoutingKeys matches (403).
	CodeRoutingKeyNotAllowed = "routing_key_not_allowed"
	// CodeRoutingKeyInvalid: the routing key is given twice, is longer
	// than AMQP allows, or is empty where the default exchange needs a
	// queue name (400).
	CodeRoutingKeyInvalid = "routing_key_invalid"
)

// MaxRoutingKey is the longest routing key AMQP carries (a short string).
const MaxRoutingKey = 255

// RoutingKeyParam is the query parameter a request names its routing key in.
const RoutingKeyParam = "routing_key"

// pattern is one parsed AMQP topic pattern: its words, "*" standing for
// exactly one word and "#" for zero or more.
type pattern []string

// parsePattern parses an allowed routing key pattern. "*" and "#" are
// wildcards only as whole words ("orders.*", "audit.#"); inside a word
// ("order*") they would read as a glob that AMQP does not have, so they are
// refused.
func parsePattern(s string) (pattern, error) {
	if len(s) > MaxRoutingKey {
		return nil, fmt.Errorf("routing key pattern %.20q…: longer than %d bytes", s, MaxRoutingKey)
	}
	words := strings.Split(s, ".")
	for _, w := range words {
		if w != "*" && w != "#" && strings.ContainsAny(w, "*#") {
			return nil, fmt.Errorf("routing key pattern %q: * and # stand for whole words only (as in orders.* or audit.#)", s)
		}
	}
	return words, nil
}

// CheckRoutingKeys returns an error naming the first of patterns that is not
// a routing key pattern Config.AllowRoutingKeys takes.
func CheckRoutingKeys(patterns []string) error {
	for _, s := range patterns {
		if _, err := parsePattern(s); err != nil {
			return err
		}
	}
	return nil
}

// match reports whether routing key rk matches p, the way a topic exchange
// matches a binding key.
func (p pattern) match(rk string) bool {
	return matchWords(p, strings.Split(rk, "."))
}

func matchWords(p, words []string) bool {
	for len(p) > 0 {
		switch p[0] {
		case "#":
			// Zero or more words: try every tail.
			for i := 0; i <= len(words); i++ {
				if matchWords(p[1:], words[i:]) {
					return true
				}
			}
			return false
		case "*":
			if len(words) == 0 {
				return false
			}
		default:
			if len(words) == 0 || words[0] != p[0] {
				return false
			}
		}
		p, words = p[1:], words[1:]
	}
	return len(words) == 0
}

// routes decides the routing key of a request: Config.RoutingKey unless the
// query names another, which must be RoutingKey itself or match one of the
// allowed patterns.
type routes struct {
	exchange, fallback string
	allowed            []pattern
}

func newRoutes(exchange, fallback string, allow []string) (*routes, error) {
	r := &routes{exchange: exchange, fallback: fallback}
	for _, s := range allow {
		p, err := parsePattern(s)
		if err != nil {
			return nil, err
		}
		r.allowed = append(r.allowed, p)
	}
	if exchange == "" && fallback == "" && len(r.allowed) == 0 {
		return nil, fmt.Errorf("the default exchange routes by queue name: give a routing key or the patterns requests may name")
	}
	if len(fallback) > MaxRoutingKey {
		return nil, fmt.Errorf("routing key %.20q…: longer than %d bytes", fallback, MaxRoutingKey)
	}
	return r, nil
}

// refusal is a request's routing key refused: the status and problem code
// it is answered with.
type refusal struct {
	status       int
	code, detail string
}

// of returns the routing key of r, or why it is refused.
func (rt *routes) of(r *http.Request) (string, *refusal) {
	vals := r.URL.Query()[RoutingKeyParam]
	if len(vals) > 1 {
		return "", &refusal{http.StatusBadRequest, CodeRoutingKeyInvalid, "the routing_key parameter appears more than once"}
	}
	rk := rt.fallback
	if len(vals) == 1 && vals[0] != "" {
		rk = vals[0]
	}
	switch {
	case len(rk) > MaxRoutingKey:
		return "", &refusal{http.StatusBadRequest, CodeRoutingKeyInvalid, "the routing key is longer than " + strconv.Itoa(MaxRoutingKey) + " bytes"}
	case rk == "" && rt.exchange == "":
		return "", &refusal{http.StatusBadRequest, CodeRoutingKeyInvalid, "this gateway publishes to the default exchange: name the queue in ?routing_key="}
	case rk == rt.fallback:
		return rk, nil
	}
	for _, p := range rt.allowed {
		if p.match(rk) {
			return rk, nil
		}
	}
	return "", &refusal{http.StatusForbidden, CodeRoutingKeyNotAllowed, "this gateway does not publish with that routing key"}
}

type routingKeyCtx struct{}

// route refuses, before the key is reserved (nothing is stored: the same key
// with an allowed routing key is a first request), a request whose routing
// key the configuration does not allow, and hands the routing key to accept
// in the request's context. A request without a known token is passed on
// untouched: the middleware answers it 401 before anything else.
func (g *Gateway) route(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := g.tenant(r); err != nil {
			next.ServeHTTP(w, r)
			return
		}
		rk, no := g.routes.of(r)
		if no != nil {
			g.problem(w, no.status, no.code, no.detail)
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), routingKeyCtx{}, rk)))
	})
}

// routingKey is the routing key route decided for r.
func routingKey(r *http.Request) string {
	rk, _ := r.Context().Value(routingKeyCtx{}).(string)
	return rk
}

// problem writes an RFC 9457 problem body, as the middleware writes its own:
// the same members, its type under the same DocURL.
func (g *Gateway) problem(w http.ResponseWriter, status int, code, detail string) {
	typ := "about:blank"
	if g.cfg.Middleware.DocURL != "" {
		typ = g.cfg.Middleware.DocURL + "#" + code
	}
	body, _ := json.Marshal(idemhttp.Problem{Type: typ, Title: http.StatusText(status), Status: status, Detail: detail, Code: code})
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write(body)
}
