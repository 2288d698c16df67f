package jaeger

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Trace is one trace as the query API returns it, its spans in start order.
type Trace struct {
	// ID is the trace id, 32 lowercase hex digits.
	ID    string
	Spans []Span
	// Warnings are what the Jaeger noted about the trace (clock skew, an
	// unknown parent).
	Warnings []string
}

// Span is one span of a trace.
type Span struct {
	TraceID, SpanID string
	// ParentID is the span's CHILD_OF reference in its own trace ("" for
	// a root span).
	ParentID string
	Name     string
	// Service is the service.name of the process that sent the span.
	Service  string
	Start    time.Time
	Duration time.Duration
	// Tags are the span's attributes, as Jaeger gives them (it adds
	// span.kind, otel.scope.name and the status as tags).
	Tags []Tag
	// Refs are the span's references but its parent: FOLLOWS_FROM for an
	// OTel span link, CHILD_OF for a parent in another trace.
	Refs []Ref
	// Events are the span's events (Jaeger's logs).
	Events []Event
	// Warnings are what the Jaeger noted about the span.
	Warnings []string
}

// Ref is a reference from a span to another span.
type Ref struct {
	// Type is FOLLOWS_FROM (an OTel span link) or CHILD_OF.
	Type            string
	TraceID, SpanID string
}

// Reference types of the query API.
const (
	ChildOf     = "CHILD_OF"
	FollowsFrom = "FOLLOWS_FROM"
)

// Tag is an attribute: a key, its type (string, bool, int64, float64,
// binary) and its value.
type Tag struct {
	Key, Type string
	Value     any
}

// Text is the tag's value as text.
func (t Tag) Text() string {
	switch v := t.Value.(type) {
	case string:
		return v
	case float64:
		// JSON numbers arrive as float64: an int64 tag reads as an integer.
		if v == float64(int64(v)) {
			return strconv.FormatInt(int64(v), 10)
		}
		return strconv.FormatFloat(v, 'g', -1, 64)
	case nil:
		return ""
	}
	return fmt.Sprint(t.Value)
}

// Event is a span event: when, its name and its attributes.
type Event struct {
	Time time.Time
	Name string
	Tags []Tag
}

// Tag returns the text of the span's tag key, and whether it has one.
func (s Span) Tag(key string) (string, bool) { return tagText(s.Tags, key) }

// Tag returns the text of the event's attribute key, and whether it has one.
func (e Event) Tag(key string) (string, bool) { return tagText(e.Tags, key) }

func tagText(tags []Tag, key string) (string, bool) {
	for _, t := range tags {
		if t.Key == key {
			return t.Text(), true
		}
	}
	return "", false
}

// End is when the span ended.
func (s Span) End() time.Time { return s.Start.Add(s.Duration) }

// Kind is the span's kind (consumer, producer, server, client, internal).
func (s Span) Kind() string { v, _ := s.Tag("span.kind"); return v }

// Status is the span's status: "error", "ok" or "" (unset), from the
// tags the Jaeger writes for an OTel status (otel.status_code) or an
// OpenTracing error tag (error=true); and the status description.
func (s Span) Status() (status, description string) {
	description, _ = s.Tag("otel.status_description")
	code, _ := s.Tag("otel.status_code")
	if e, _ := s.Tag("error"); e == "true" || strings.EqualFold(code, "ERROR") {
		return "error", description
	}
	if strings.EqualFold(code, "OK") {
		return "ok", description
	}
	return "", description
}

// Span returns the span of t with id spanID, or nil.
func (t *Trace) Span(spanID string) *Span {
	spanID = normalizeSpanID(spanID)
	for i := range t.Spans {
		if t.Spans[i].SpanID == spanID {
			return &t.Spans[i]
		}
	}
	return nil
}

// Start is when the trace's first span started.
func (t *Trace) Start() time.Time {
	if len(t.Spans) == 0 {
		return time.Time{}
	}
	return t.Spans[0].Start
}

// Duration is from the first span's start to the last span's end.
func (t *Trace) Duration() time.Duration {
	var end time.Time
	for _, s := range t.Spans {
		if e := s.End(); e.After(end) {
			end = e
		}
	}
	if len(t.Spans) == 0 {
		return 0
	}
	return end.Sub(t.Start())
}

// The query API's JSON (the same in Jaeger v1 and v2).
type (
	wireTrace struct {
		TraceID   string                 `json:"traceID"`
		Spans     []wireSpan             `json:"spans"`
		Processes map[string]wireProcess `json:"processes"`
		Warnings  []string               `json:"warnings"`
	}
	wireProcess struct {
		ServiceName string    `json:"serviceName"`
		Tags        []wireTag `json:"tags"`
	}
	wireSpan struct {
		TraceID       string    `json:"traceID"`
		SpanID        string    `json:"spanID"`
		OperationName string    `json:"operationName"`
		References    []wireRef `json:"references"`
		// ParentSpanID is what Jaeger v1 wrote before references did.
		ParentSpanID string    `json:"parentSpanID"`
		StartTime    int64     `json:"startTime"` // µs since the epoch
		Duration     int64     `json:"duration"`  // µs
		Tags         []wireTag `json:"tags"`
		Logs         []wireLog `json:"logs"`
		ProcessID    string    `json:"processID"`
		// Process is inline in some v1 answers instead of in processes.
		Process  *wireProcess `json:"process"`
		Warnings []string     `json:"warnings"`
	}
	wireRef struct {
		RefType string `json:"refType"`
		TraceID string `json:"traceID"`
		SpanID  string `json:"spanID"`
	}
	wireTag struct {
		Key   string `json:"key"`
		Type  string `json:"type"`
		Value any    `json:"value"`
	}
	wireLog struct {
		Timestamp int64     `json:"timestamp"` // µs
		Fields    []wireTag `json:"fields"`
	}
)

func tags(in []wireTag) []Tag {
	out := make([]Tag, 0, len(in))
	for _, t := range in {
		out = append(out, Tag{Key: t.Key, Type: t.Type, Value: t.Value})
	}
	return out
}

func micros(us int64) time.Time { return time.UnixMicro(us).UTC() }

// trace turns the wire form into a Trace: ids normalized, the service
// resolved, the parent told from the other references, events named.
func (wt wireTrace) trace() *Trace {
	id, err := NormalizeTraceID(wt.TraceID)
	if err != nil {
		id = wt.TraceID
	}
	t := &Trace{ID: id, Warnings: wt.Warnings}
	for _, ws := range wt.Spans {
		s := Span{
			TraceID: id, SpanID: normalizeSpanID(ws.SpanID), Name: ws.OperationName,
			Start: micros(ws.StartTime), Duration: time.Duration(ws.Duration) * time.Microsecond,
			Tags: tags(ws.Tags), Warnings: ws.Warnings,
		}
		if tid, err := NormalizeTraceID(ws.TraceID); err == nil {
			s.TraceID = tid
		}
		if p, ok := wt.Processes[ws.ProcessID]; ok {
			s.Service = p.ServiceName
		} else if ws.Process != nil {
			s.Service = ws.Process.ServiceName
		}
		for _, r := range ws.References {
			ref := Ref{Type: strings.ToUpper(r.RefType), TraceID: r.TraceID, SpanID: normalizeSpanID(r.SpanID)}
			if tid, err := NormalizeTraceID(r.TraceID); err == nil {
				ref.TraceID = tid
			}
			if ref.Type == ChildOf && ref.TraceID == s.TraceID && s.ParentID == "" {
				s.ParentID = ref.SpanID
				continue
			}
			s.Refs = append(s.Refs, ref)
		}
		if s.ParentID == "" && ws.ParentSpanID != "" && strings.Trim(ws.ParentSpanID, "0") != "" {
			s.ParentID = normalizeSpanID(ws.ParentSpanID)
		}
		for _, l := range ws.Logs {
			ev := Event{Time: micros(l.Timestamp)}
			for _, f := range l.Fields {
				if f.Key == "event" && ev.Name == "" {
					ev.Name = Tag{Value: f.Value}.Text()
					continue
				}
				ev.Tags = append(ev.Tags, Tag{Key: f.Key, Type: f.Type, Value: f.Value})
			}
			s.Events = append(s.Events, ev)
		}
		t.Spans = append(t.Spans, s)
	}
	slices.SortStableFunc(t.Spans, func(a, b Span) int { return a.Start.Compare(b.Start) })
	return t
}

// Tree returns t's spans in tree order (each span after its parent, the
// children of one parent by start), each with its depth (0 for a root or
// a span whose parent is not in the trace).
func (t *Trace) Tree() []TreeSpan {
	byParent := map[string][]int{}
	known := map[string]bool{}
	for _, s := range t.Spans {
		known[s.SpanID] = true
	}
	var roots []int
	for i, s := range t.Spans {
		if s.ParentID == "" || !known[s.ParentID] || s.ParentID == s.SpanID {
			roots = append(roots, i)
			continue
		}
		byParent[s.ParentID] = append(byParent[s.ParentID], i)
	}
	out := make([]TreeSpan, 0, len(t.Spans))
	seen := make([]bool, len(t.Spans))
	var walk func(i, depth int)
	walk = func(i, depth int) {
		if seen[i] {
			return
		}
		seen[i] = true
		out = append(out, TreeSpan{Span: &t.Spans[i], Depth: depth})
		for _, c := range byParent[t.Spans[i].SpanID] {
			walk(c, depth+1)
		}
	}
	for _, r := range roots {
		walk(r, 0)
	}
	// Spans in a cycle of parents (a broken trace) come last, flat.
	for i := range t.Spans {
		if !seen[i] {
			walk(i, 0)
		}
	}
	return out
}

// TreeSpan is a span with its depth in the trace's tree.
type TreeSpan struct {
	*Span
	Depth int
}
