// Package jaeger reads traces from Jaeger's query API, the JSON API under
// /api/ that every Jaeger serves (v1 and v2, with or without its UI), for
// the pages of `idemq ui` that show suppressed duplicates and their traces.
//
// # What it reads
//
//   - GET /api/services: the services that sent spans.
//   - GET /api/traces?service=&tags=&start=&end=&limit=: the traces of a
//     service holding a span with the given tags (values as strings),
//     started between start and end (unix microseconds).
//   - GET /api/traces/{id}: one trace.
//   - GET /: whether the Jaeger serves its UI, or only the placeholder page
//     of a Jaeger built without the UI's assets (deploy/jaeger).
//
// Every read is bounded: a timeout per request and a cap on the bytes of an
// answer. An OTel span link shows in the JSON as a FOLLOWS_FROM reference;
// the parent is the CHILD_OF one. Trace ids are given and returned as 32
// lowercase hex digits, whatever padding the Jaeger writes them with.
package jaeger

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Defaults used where Config leaves a field zero.
const (
	// DefaultTimeout bounds one request to the Jaeger.
	DefaultTimeout = 5 * time.Second
	// DefaultMaxBody bounds the bytes read from one answer.
	DefaultMaxBody = 16 << 20
	// uiCheckEvery is how long an answer of HasUI is kept.
	uiCheckEvery = time.Minute
)

// Placeholder is a phrase of the page a Jaeger built without its UI's
// assets serves at / (the local one of deploy/jaeger does).
const Placeholder = "This is not the Jaeger UI you are looking for"

// Paths of the idemq UI's own pages over Jaeger (package ui serves them).
const (
	// DuplicatesPath lists the recent suppressed duplicates.
	DuplicatesPath = "/duplicates"
	// TracePath shows one trace: TracePath + "?id=" + trace id.
	TracePath = "/trace"
)

// TracePageURL is the link to the idemq UI's page of trace id, on the UI
// at base (e.g. http://127.0.0.1:8089); "" when either is empty.
func TracePageURL(base, id string) string {
	if base == "" || id == "" {
		return ""
	}
	return strings.TrimRight(base, "/") + TracePath + "?id=" + url.QueryEscape(id)
}

// ErrNotFound means the Jaeger holds no trace of the id asked for.
var ErrNotFound = errors.New("trace not found in Jaeger")

// Config configures a Client. The zero value is valid.
type Config struct {
	// HTTPClient makes the requests. Default: a client of its own (its own
	// connections) with Timeout.
	HTTPClient *http.Client
	// Timeout bounds each request. Default DefaultTimeout.
	Timeout time.Duration
	// MaxBody bounds the bytes read from one answer. Default DefaultMaxBody.
	MaxBody int64
}

// Client reads one Jaeger's query API. It is safe for concurrent use.
type Client struct {
	base    string
	hc      *http.Client
	timeout time.Duration
	maxBody int64

	mu      sync.Mutex
	hasUI   bool
	uiErr   error
	uiCheck time.Time
}

// New returns a client of the Jaeger whose query API is at base, the URL
// its UI is (or would be) served at, e.g. http://127.0.0.1:16686 (with
// its base path, if it has one). cfg may be nil.
func New(base string, cfg *Config) (*Client, error) {
	u, err := url.Parse(base)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
		return nil, fmt.Errorf("jaeger: %q is not a base URL (http://host:port[/path])", base)
	}
	if cfg == nil {
		cfg = &Config{}
	}
	c := &Client{
		base:    strings.TrimRight(base, "/"),
		timeout: cmp.Or(cfg.Timeout, DefaultTimeout),
		maxBody: cmp.Or(cfg.MaxBody, DefaultMaxBody),
		hc:      cfg.HTTPClient,
	}
	if c.hc == nil {
		c.hc = &http.Client{Timeout: c.timeout, Transport: http.DefaultTransport.(*http.Transport).Clone()}
	}
	return c, nil
}

// Close closes the client's idle connections to the Jaeger.
func (c *Client) Close() { c.hc.CloseIdleConnections() }

// Base is the Jaeger's base URL, without a trailing slash.
func (c *Client) Base() string { return c.base }

// UITraceURL is the link to trace id in the Jaeger's own UI (which only a
// Jaeger with its UI serves: see HasUI).
func (c *Client) UITraceURL(id string) string { return c.base + "/trace/" + id }

// Services returns the names of the services the Jaeger holds spans of.
func (c *Client) Services(ctx context.Context) ([]string, error) {
	var out []string
	if err := c.getJSON(ctx, "/api/services", nil, &out); err != nil {
		return nil, fmt.Errorf("jaeger: services: %w", err)
	}
	return out, nil
}

// Trace returns trace id (32 hex digits). A trace the Jaeger does not hold
// is an error wrapping ErrNotFound.
func (c *Client) Trace(ctx context.Context, id string) (*Trace, error) {
	id, err := NormalizeTraceID(id)
	if err != nil {
		return nil, err
	}
	var out []wireTrace
	if err := c.getJSON(ctx, "/api/traces/"+id, nil, &out); err != nil {
		return nil, fmt.Errorf("jaeger: trace %s: %w", id, err)
	}
	for _, wt := range out {
		if t := wt.trace(); t.ID == id {
			return t, nil
		}
	}
	return nil, fmt.Errorf("jaeger: trace %s: %w", id, ErrNotFound)
}

// Query selects traces for Find.
type Query struct {
	// Service is required: Jaeger searches one service at a time.
	Service string
	// Operation, when set, is the name of the span searched for.
	Operation string
	// Tags are attributes the span searched for carries, each value as
	// text (Jaeger compares "2" with an int attribute 2).
	Tags map[string]string
	// Start and End bound when the span started; zero End is now, zero
	// Start is the Jaeger's default (its lookback, 48 h by default).
	Start, End time.Time
	// Limit is the most traces returned (Jaeger's default 100 when zero).
	Limit int
}

// Find returns the traces of q.Service that hold a span matching q.
func (c *Client) Find(ctx context.Context, q Query) ([]*Trace, error) {
	if q.Service == "" {
		return nil, errors.New("jaeger: find: a service is required")
	}
	v := url.Values{"service": {q.Service}}
	if q.Operation != "" {
		v.Set("operation", q.Operation)
	}
	if len(q.Tags) > 0 {
		b, err := json.Marshal(q.Tags)
		if err != nil {
			return nil, fmt.Errorf("jaeger: find: %w", err)
		}
		v.Set("tags", string(b))
	}
	if !q.Start.IsZero() {
		v.Set("start", strconv.FormatInt(q.Start.UnixMicro(), 10))
	}
	if !q.End.IsZero() {
		v.Set("end", strconv.FormatInt(q.End.UnixMicro(), 10))
	}
	if q.Limit > 0 {
		v.Set("limit", strconv.Itoa(q.Limit))
	}
	var out []wireTrace
	if err := c.getJSON(ctx, "/api/traces", v, &out); err != nil {
		return nil, fmt.Errorf("jaeger: find in %s: %w", q.Service, err)
	}
	traces := make([]*Trace, 0, len(out))
	for _, wt := range out {
		traces = append(traces, wt.trace())
	}
	return traces, nil
}

// HasUI reports whether the Jaeger serves its UI at its base URL (and so
// whether its trace links open anything): its / answers 200 with a page
// that is not the placeholder of a Jaeger built without the UI's assets.
// The answer is kept for a minute.
func (c *Client) HasUI(ctx context.Context) (bool, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.uiCheck.IsZero() && time.Since(c.uiCheck) < uiCheckEvery {
		return c.hasUI, c.uiErr
	}
	c.hasUI, c.uiErr = c.checkUI(ctx)
	c.uiCheck = time.Now()
	return c.hasUI, c.uiErr
}

func (c *Client) checkUI(ctx context.Context) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+"/", nil)
	if err != nil {
		return false, err
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return false, fmt.Errorf("jaeger: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return false, nil
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return false, fmt.Errorf("jaeger: %w", err)
	}
	return !strings.Contains(string(b), Placeholder), nil
}

// apiError is what the query API answers besides its data.
type apiError struct {
	Code int    `json:"code"`
	Msg  string `json:"msg"`
}

// getJSON reads path's answer's "data" into out.
func (c *Client) getJSON(ctx context.Context, path string, q url.Values, out any) error {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	u := c.base + path
	if len(q) > 0 {
		u += "?" + q.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Accept", "application/json")
	resp, err := c.hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, c.maxBody+1))
	if err != nil {
		return fmt.Errorf("read the answer: %w", err)
	}
	if int64(len(body)) > c.maxBody {
		return fmt.Errorf("the answer is larger than %d bytes", c.maxBody)
	}
	var a struct {
		Data   json.RawMessage `json:"data"`
		Errors []apiError      `json:"errors"`
		apiError
	}
	jsonErr := json.Unmarshal(body, &a)
	switch {
	case resp.StatusCode == http.StatusNotFound:
		return ErrNotFound
	case resp.StatusCode != http.StatusOK || len(a.Errors) > 0:
		msg := resp.Status
		for _, e := range append(a.Errors, a.apiError) {
			if e.Msg != "" {
				msg += ": " + e.Msg
			}
		}
		return fmt.Errorf("GET %s: %s", path, msg)
	case jsonErr != nil:
		return fmt.Errorf("GET %s: not the query API's JSON (%s): %w", path, resp.Header.Get("Content-Type"), jsonErr)
	case len(a.Data) == 0 || string(a.Data) == "null":
		return nil
	}
	if err := json.Unmarshal(a.Data, out); err != nil {
		return fmt.Errorf("GET %s: %w", path, err)
	}
	return nil
}

// NormalizeTraceID returns id as 32 lowercase hex digits: Jaeger v1 drops
// the leading zeros of a trace id, OTel and v2 keep them. An id that is not
// 1 to 32 hex digits, or all zeros, is an error.
func NormalizeTraceID(id string) (string, error) {
	id = strings.ToLower(strings.TrimSpace(id))
	if id == "" || len(id) > 32 || strings.Trim(id, "0") == "" || strings.ContainsFunc(id, notHex) {
		return "", fmt.Errorf("trace id %q: want 32 hex digits", id)
	}
	return strings.Repeat("0", 32-len(id)) + id, nil
}

// normalizeSpanID is NormalizeTraceID for a span id (16 hex digits); an
// invalid id is returned as it is.
func normalizeSpanID(id string) string {
	id = strings.ToLower(id)
	if id == "" || len(id) > 16 || strings.ContainsFunc(id, notHex) {
		return id
	}
	return strings.Repeat("0", 16-len(id)) + id
}

func notHex(r rune) bool { return !('0' <= r && r <= '9' || 'a' <= r && r <= 'f') }
