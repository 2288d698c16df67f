package idemhttp

import (
	"encoding/json"
	"net/http"
	"strconv"
	"time"
)

// The problem codes: the "code" member of a problem body, and the fragment
// of its "type" under Config.DocURL. They are the words the consumer uses
// for the same situations of a message.
const (
	CodeKeyRequired     = "idempotency_key_required"
	CodeKeyInvalid      = "idempotency_key_invalid"
	CodeKeyInProgress   = "idempotency_key_in_progress"
	CodeKeyReuse        = "idempotency_key_reuse"
	CodeBodyTooLarge    = "request_body_too_large"
	CodeBodyUnreadable  = "request_body_unreadable"
	CodeUnauthenticated = "tenant_unknown"
	CodeTenantInvalid   = "tenant_invalid" // the tenant breaks dedup.ValidateTenant
	CodeUnavailable     = "idempotency_store_unavailable"
	CodeTimeout         = "request_timeout"
	CodeLeaseLost       = "idempotency_key_taken_over"
	CodeHandlerPanic    = "internal_error"
)

// Problem is an RFC 9457 problem details body, with the extension member
// "code".
type Problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail,omitempty"`
	Code   string `json:"code"`
}

// problem writes an application/problem+json answer.
func (m *Middleware) problem(w http.ResponseWriter, status int, code, detail string, retryAfter time.Duration) {
	answeredProblem(w, code)
	typ := "about:blank"
	if m.cfg.DocURL != "" {
		typ = m.cfg.DocURL + "#" + code
	}
	body, _ := json.Marshal(Problem{Type: typ, Title: http.StatusText(status), Status: status, Detail: detail, Code: code})
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	if retryAfter > 0 {
		h.Set("Retry-After", strconv.FormatInt(int64((retryAfter+time.Second-1)/time.Second), 10))
	}
	w.WriteHeader(status)
	_, _ = w.Write(body)
}
