package idemhttp

import (
	"bytes"
	"maps"
	"net/http"
	"strconv"
)

// capture is the ResponseWriter a guarded handler writes to: it keeps the
// status, the headers and the body, and sends nothing until the middleware
// has committed (or rolled back) the request's transaction. It does not
// implement http.Flusher or http.Hijacker: a guarded response cannot stream.
// Informational answers (1xx but 101, such as 103 Early Hints) are no
// result: they go to the client as they are written, with the headers set
// so far, and are never stored nor replayed.
type capture struct {
	w      http.ResponseWriter // the client's
	header http.Header
	status int // the first final status: 2xx to 5xx, or 101
	body   bytes.Buffer
}

func newCapture(w http.ResponseWriter) *capture { return &capture{w: w, header: http.Header{}} }

func (c *capture) Header() http.Header { return c.header }

func (c *capture) WriteHeader(status int) {
	if c.status != 0 {
		return
	}
	if informational(status) {
		c.inform(status)
		return
	}
	c.status = status
}

// informational reports a 1xx status that precedes the final answer.
// 101 Switching Protocols is final: the connection then speaks another
// protocol.
func informational(status int) bool {
	return status >= 100 && status < 200 && status != http.StatusSwitchingProtocols
}

// inform sends an informational answer with the headers the handler has
// set so far, as net/http does, and leaves the client's header map as it
// was, so that the final answer carries what the middleware decides.
func (c *capture) inform(status int) {
	h := c.w.Header()
	saved := h.Clone()
	maps.Copy(h, c.header)
	c.w.WriteHeader(status)
	clear(h)
	maps.Copy(h, saved)
}

func (c *capture) Write(p []byte) (int, error) {
	if c.status == 0 {
		c.status = http.StatusOK
	}
	return c.body.Write(p)
}

// code is the status the handler answered (200 when it wrote nothing).
func (c *capture) code() int {
	if c.status == 0 {
		return http.StatusOK
	}
	return c.status
}

// stored returns the headers to store: all but the omitted ones, or only the
// listed ones.
func (m *Middleware) stored(h http.Header) map[string][]string {
	out := map[string][]string{}
	for name, values := range h {
		if m.keepHeader(name) {
			out[name] = values
		}
	}
	if len(out) == 0 {
		return nil
	}
	return out
}

func (m *Middleware) keepHeader(name string) bool {
	name = http.CanonicalHeaderKey(name)
	if m.cfg.StoredHeaders != nil {
		_, ok := m.storedHeaders[name]
		return ok
	}
	_, omit := m.omitted[name]
	return !omit
}

// send writes a response to the client: headers, status, body.
func send(w http.ResponseWriter, headers map[string][]string, status int, body []byte, replayed bool) {
	h := w.Header()
	for name, values := range headers {
		h[name] = values
	}
	if replayed {
		h.Set(ReplayedHeader, "true")
	}
	if status >= 200 && status != http.StatusNoContent && status != http.StatusNotModified {
		h.Set("Content-Length", strconv.Itoa(len(body)))
	}
	w.WriteHeader(status)
	_, _ = w.Write(body)
}
