package testdb

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"net/url"
	"strconv"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Proxy is a TCP proxy in front of the test database that a test can turn
// into a black hole: it stops forwarding in both directions without closing
// anything, as a dropped network does (no RST, no FIN), so that the clients'
// reads hang until their own deadlines. Bytes held during the black hole are
// forwarded once it is lifted, as TCP retransmits them after a partition
// heals. Cut is the other outage: every connection through it is closed, and
// each new one at once, until Restore.
type Proxy struct {
	ln     net.Listener
	target string

	mu      sync.Mutex
	dark    chan struct{} // closed while forwarding; replaced by an open one in a black hole
	trigger []byte
	tripped chan struct{}
	conns   map[net.Conn]struct{}
	cut     bool
	refused int // connections closed at once while cut
}

// NewProxy starts a proxy to the test database's host and port; it stops
// when the test ends.
func NewProxy(tb testing.TB) *Proxy {
	tb.Helper()
	u, err := url.Parse(URL())
	if err != nil {
		tb.Fatalf("testdb: parse IDEMQ_TEST_POSTGRES_URL: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("testdb: proxy listen: %v", err)
	}
	p := &Proxy{ln: ln, target: u.Host, dark: make(chan struct{}), conns: map[net.Conn]struct{}{}}
	close(p.dark)
	go p.accept()
	tb.Cleanup(p.close)
	return p
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Pool opens a pool of at most maxConns connections through the proxy and
// closes it when the test ends.
func (p *Proxy) Pool(tb testing.TB, maxConns int32) *pgxpool.Pool {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig(URL())
	if err != nil {
		tb.Fatalf("testdb: parse IDEMQ_TEST_POSTGRES_URL: %v", err)
	}
	host, port, _ := net.SplitHostPort(p.Addr())
	n, _ := strconv.ParseUint(port, 10, 16)
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = host, uint16(n)
	cfg.ConnConfig.Fallbacks = nil
	cfg.MaxConns = maxConns
	return open(tb, cfg, "Postgres is not reachable through the proxy")
}

// BlackHoleOn arms a trip wire: the first chunk a client sends that contains
// trigger is held, and from then on the proxy is a black hole (see
// BlackHole). Tripped is closed when it fires.
func (p *Proxy) BlackHoleOn(trigger []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.trigger = bytes.Clone(trigger)
	p.tripped = make(chan struct{})
}

// Tripped is closed once the trip wire armed by BlackHoleOn has fired.
func (p *Proxy) Tripped() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.tripped
}

// BlackHole stops forwarding, in both directions and on every connection,
// new ones included, without closing any.
func (p *Proxy) BlackHole() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.blackHoleLocked()
}

func (p *Proxy) blackHoleLocked() {
	select {
	case <-p.dark:
		p.dark = make(chan struct{})
	default: // already dark
	}
}

// Cut closes every connection through the proxy and, until Restore, each
// new one as soon as it is accepted: Postgres is out of reach, and says so
// at once (the clients read EOF), as a server that went down does.
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = true
	for c := range p.conns {
		_ = c.Close()
	}
}

// Refused is the number of connections closed at once while the proxy was
// cut.
func (p *Proxy) Refused() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.refused
}

// Restore lifts the black hole and the cut and disarms the trip wire: what
// was held is forwarded, and new connections are again.
func (p *Proxy) Restore() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = false
	p.trigger = nil
	select {
	case <-p.dark:
	default:
		close(p.dark)
	}
}

// SimpleQuery is the wire form of a simple-protocol query message, as pgx
// sends "begin", "commit" or an Exec without arguments: a trigger that
// matches that statement and no other.
func SimpleQuery(sql string) []byte {
	msg := []byte{'Q', 0, 0, 0, 0}
	binary.BigEndian.PutUint32(msg[1:], uint32(4+len(sql)+1))
	msg = append(msg, sql...)
	return append(msg, 0)
}

func (p *Proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		go p.serve(c)
	}
}

func (p *Proxy) serve(client net.Conn) {
	p.mu.Lock()
	cut := p.cut
	if cut {
		p.refused++
	}
	p.mu.Unlock()
	if cut {
		_ = client.Close()
		return
	}
	server, err := net.Dial("tcp", p.target)
	if err != nil {
		_ = client.Close()
		return
	}
	p.mu.Lock()
	if p.cut {
		p.mu.Unlock()
		_ = client.Close()
		_ = server.Close()
		return
	}
	p.conns[client], p.conns[server] = struct{}{}, struct{}{}
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		delete(p.conns, client)
		delete(p.conns, server)
		p.mu.Unlock()
		_ = client.Close()
		_ = server.Close()
	}()
	done := make(chan struct{}, 2)
	go func() { p.pipe(server, client, true); done <- struct{}{} }()
	go func() { p.pipe(client, server, false); done <- struct{}{} }()
	<-done
}

// pipe copies src to dst, holding each chunk while the proxy is dark.
// fromClient chunks are checked against the trip wire, with the tail of the
// previous chunk so that a trigger split between two reads still matches.
func (p *Proxy) pipe(dst, src net.Conn, fromClient bool) {
	buf := make([]byte, 32<<10)
	var tail []byte
	for {
		n, err := src.Read(buf)
		if n > 0 {
			chunk := buf[:n]
			p.mu.Lock()
			if fromClient && p.trigger != nil {
				if bytes.Contains(append(tail, chunk...), p.trigger) {
					p.trigger = nil
					close(p.tripped)
					p.blackHoleLocked()
				}
				tail = append(tail[:0], chunk[max(0, n-len(p.trigger)):]...)
			}
			dark := p.dark
			p.mu.Unlock()
			<-dark
			if _, err := dst.Write(chunk); err != nil {
				return
			}
		}
		if err != nil {
			if err != io.EOF {
				return
			}
			if tc, ok := dst.(*net.TCPConn); ok {
				_ = tc.CloseWrite()
			}
			return
		}
	}
}

func (p *Proxy) close() {
	_ = p.ln.Close()
	p.Restore()
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		_ = c.Close()
	}
}
