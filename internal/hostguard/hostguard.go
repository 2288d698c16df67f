// Package hostguard refuses HTTP requests whose Host names a server other
// than the one listening, the defence of every server idemq runs against DNS
// rebinding: a web page whose name an attacker rebinds to 127.0.0.1 (or to
// the server's address) is same-origin with the server in the victim's
// browser, but its requests still carry the attacker's name in Host.
//
// A request is let through when its Host (without the port, compared without
// regard to case and to a trailing dot) is
//   - an IP literal the server may be reached at: the listen address's IP, a
//     loopback IP when the server listens on loopback, any IP when it
//     listens on every interface (an IP literal cannot be rebound: a page can
//     only be at that address if the user opened it there);
//   - "localhost" (or a name under .localhost), which browsers resolve to
//     loopback themselves;
//   - the listen address's host name;
//   - a name the operator allowed (exactly, or "*.example.com" for names
//     under example.com).
//
// Anything else, an empty Host included, gets 421 Misdirected Request.
package hostguard

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strings"
)

// Guard decides which Host values a server answers to. Build it with New.
type Guard struct {
	listenIP  netip.Addr // valid when the server listens on one IP
	wildcard  bool       // listens on every interface
	loopback  bool       // listens on a loopback address (or localhost)
	names     map[string]bool
	suffixes  []string // from "*.example.com": ".example.com"
	allowText string   // for the refusal's message
}

// New returns the guard of a server listening on listen (host:port, as given
// to net.Listen) that also answers to the names in allow.
func New(listen string, allow []string) (*Guard, error) {
	host, _, err := net.SplitHostPort(listen)
	if err != nil {
		return nil, fmt.Errorf("host guard: listen address %q: %w", listen, err)
	}
	g := &Guard{names: map[string]bool{}}
	host = normalize(host)
	switch ip, err := netip.ParseAddr(host); {
	case host == "":
		g.wildcard = true
	case err == nil && ip.IsUnspecified():
		g.wildcard = true
	case err == nil:
		g.listenIP = ip.Unmap()
		g.loopback = ip.IsLoopback()
	case isLocalhost(host):
		g.loopback = true
	default:
		g.names[host] = true
	}
	for _, a := range allow {
		for _, name := range strings.Split(a, ",") {
			name = normalize(strings.TrimSpace(name))
			switch {
			case name == "":
				continue
			case strings.HasPrefix(name, "*."):
				if strings.ContainsAny(name[1:], "*") || len(name) < 4 {
					return nil, fmt.Errorf("host guard: allowed host %q: a wildcard only as a first label, as in *.example.com", name)
				}
				g.suffixes = append(g.suffixes, name[1:])
			case strings.ContainsAny(name, "*/ :@"):
				return nil, fmt.Errorf("host guard: allowed host %q: want a host name, without port or scheme", name)
			default:
				g.names[name] = true
			}
		}
	}
	g.allowText = "localhost, the listen address"
	if len(allow) > 0 {
		g.allowText += " and " + strings.Join(allow, ", ")
	}
	return g, nil
}

// ErrMisdirected is what Check returns for a Host the server does not answer to.
var ErrMisdirected = errors.New("host not served here")

// Check returns nil when the server answers to hostport (a request's Host).
func (g *Guard) Check(hostport string) error {
	host := hostport
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		host = h
	} else if strings.HasPrefix(host, "[") && strings.HasSuffix(host, "]") {
		host = host[1 : len(host)-1]
	}
	host = normalize(host)
	if host == "" {
		return fmt.Errorf("%w: no Host", ErrMisdirected)
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		ip = ip.Unmap()
		if g.wildcard || ip == g.listenIP || (g.loopback && ip.IsLoopback()) {
			return nil
		}
		return fmt.Errorf("%w: %s", ErrMisdirected, host)
	}
	if isLocalhost(host) || g.names[host] {
		return nil
	}
	for _, s := range g.suffixes {
		if strings.HasSuffix(host, s) {
			return nil
		}
	}
	return fmt.Errorf("%w: %s", ErrMisdirected, host)
}

// Handler refuses with 421 Misdirected Request the requests whose Host the
// guard does not allow, and passes the others to next.
func (g *Guard) Handler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := g.Check(r.Host); err != nil {
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
			w.Header().Set("X-Content-Type-Options", "nosniff")
			w.Header().Set("Cache-Control", "no-store")
			w.WriteHeader(http.StatusMisdirectedRequest)
			fmt.Fprintf(w, "421 misdirected request: this server answers to %s only (allow another name with --allow-host)\n", g.allowText)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func normalize(host string) string {
	return strings.TrimSuffix(strings.ToLower(strings.Trim(host, "[]")), ".")
}

func isLocalhost(host string) bool {
	return host == "localhost" || strings.HasSuffix(host, ".localhost")
}
