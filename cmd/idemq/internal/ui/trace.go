package ui

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/idemq/idemq/cmd/idemq/internal/jaeger"
	"github.com/idemq/idemq/dedup"
)

// traceMaxDepth is the deepest indentation the trace page draws.
const traceMaxDepth = 12

type traceView struct {
	ID        string
	JaegerURL string
	// JaegerLink opens the trace in Jaeger's own UI, when it has one.
	JaegerLink string
	Err        string
	NotFound   bool
	Services   []string
	Start      time.Time
	Duration   time.Duration
	Spans      []traceSpan
	Warnings   []string
	// Duplicates is how many of the spans are suppressed duplicates.
	Duplicates int
	ShowKeys   bool
}

type traceSpan struct {
	ID, Name, Service, Kind string
	Depth                   int
	Offset, Duration        time.Duration
	Status, StatusDesc      string
	// X and W place the span's bar on a scale of 1000 (the trace's length).
	X, W      int
	Idemq     []traceAttr
	Other     []traceAttr
	Events    []traceEvent
	Links     []traceLink
	Duplicate bool
	Outcome   string
	Warnings  []string
}

type traceAttr struct{ Key, Value string }

type traceEvent struct {
	Offset time.Duration
	Name   string
	Attrs  []traceAttr
}

// traceLink is a reference of a span to a span of another trace (or of
// the same trace, in another branch).
type traceLink struct {
	Type, TraceID, SpanID string
	// Href is the UI's page of the linked trace, at the linked span.
	Href      string
	SameTrace bool
	// DuplicateOf: the span is a suppressed duplicate and this is the
	// processing it duplicated.
	DuplicateOf bool
}

// tracePage shows one trace read from Jaeger: its spans as a timeline in
// tree order, with their idemq attributes, events, and references to other
// traces as links to this page.
func (s *Server) tracePage(w http.ResponseWriter, r *http.Request) {
	v := traceView{JaegerURL: s.cfg.JaegerURL, ShowKeys: s.cfg.ShowKeys}
	raw := r.FormValue("id")
	id, err := jaeger.NormalizeTraceID(raw)
	if err != nil || len(strings.TrimSpace(raw)) != 32 {
		v.Err = "give a trace id of 32 hex digits: /trace?id=4bf92f3577b34da6a3ce929d0e0e4736"
		s.render(w, r, http.StatusBadRequest, "trace", "Trace", v)
		return
	}
	v.ID = id
	if s.jaeger == nil {
		s.render(w, r, http.StatusOK, "trace", "Trace "+id, v)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), jaegerPageTimeout)
	defer cancel()
	if ui, _ := s.jaeger.HasUI(ctx); ui {
		v.JaegerLink = s.jaeger.UITraceURL(id)
	}
	t, err := s.jaeger.Trace(ctx, id)
	switch {
	case errors.Is(err, jaeger.ErrNotFound):
		v.NotFound = true
		s.render(w, r, http.StatusNotFound, "trace", "Trace "+id, v)
		return
	case err != nil:
		v.Err = errText(err)
		s.render(w, r, http.StatusBadGateway, "trace", "Trace "+id, v)
		return
	}
	s.showTrace(&v, t)
	s.render(w, r, http.StatusOK, "trace", "Trace "+id, v)
}

func (s *Server) showTrace(v *traceView, t *jaeger.Trace) {
	v.Start, v.Duration, v.Warnings = t.Start(), t.Duration(), t.Warnings
	scale := max(v.Duration, time.Microsecond)
	for _, ts := range t.Tree() {
		sp := traceSpan{
			ID: ts.SpanID, Name: ts.Name, Service: ts.Service, Kind: ts.Kind(), Depth: min(ts.Depth, traceMaxDepth),
			Offset: ts.Start.Sub(v.Start), Duration: ts.Duration, Warnings: ts.Warnings,
		}
		sp.Status, sp.StatusDesc = ts.Status()
		sp.X = int(1000 * sp.Offset / scale)
		sp.W = max(int(1000*sp.Duration/scale), 2)
		sp.X = min(sp.X, 1000-sp.W)
		sp.Outcome, _ = ts.Tag(jaeger.AttrOutcome)
		sp.Duplicate = sp.Outcome == string(dedup.OutcomeDuplicate)
		if sp.Duplicate {
			v.Duplicates++
		}
		for _, tag := range ts.Tags {
			a := traceAttr{Key: tag.Key, Value: s.attrValue(tag)}
			switch {
			case strings.HasPrefix(tag.Key, "idemq."):
				sp.Idemq = append(sp.Idemq, a)
			case tag.Key == "span.kind" || strings.HasPrefix(tag.Key, "otel.status_") || tag.Key == "error":
				// shown as the kind and the status
			default:
				sp.Other = append(sp.Other, a)
			}
		}
		for _, ev := range ts.Events {
			te := traceEvent{Offset: ev.Time.Sub(v.Start), Name: ev.Name}
			for _, tag := range ev.Tags {
				te.Attrs = append(te.Attrs, traceAttr{Key: tag.Key, Value: s.attrValue(tag)})
			}
			sp.Events = append(sp.Events, te)
		}
		for i, ref := range ts.Refs {
			l := traceLink{Type: ref.Type, TraceID: ref.TraceID, SpanID: ref.SpanID, SameTrace: ref.TraceID == t.ID,
				DuplicateOf: sp.Duplicate && ref.Type == jaeger.FollowsFrom && i == firstFollows(ts.Refs)}
			if _, err := jaeger.NormalizeTraceID(ref.TraceID); err == nil {
				l.Href = jaeger.TracePath + "?id=" + ref.TraceID + "#span-" + ref.SpanID
				if l.SameTrace {
					l.Href = "#span-" + ref.SpanID
				}
			}
			sp.Links = append(sp.Links, l)
		}
		if !slices.Contains(v.Services, ts.Service) {
			v.Services = append(v.Services, ts.Service)
		}
		v.Spans = append(v.Spans, sp)
	}
}

// firstFollows is the index of the first FOLLOWS_FROM reference (-1: none):
// a duplicate's link to its original processing.
func firstFollows(refs []jaeger.Ref) int {
	return slices.IndexFunc(refs, func(r jaeger.Ref) bool { return r.Type == jaeger.FollowsFrom })
}

// attrValue is a span attribute as the page shows it: an attribute that
// holds a raw key (idemq.key, and messaging.message.id, which is often
// the key) is its short hash unless ShowKeys.
func (s *Server) attrValue(t jaeger.Tag) string {
	v := t.Text()
	if !s.cfg.ShowKeys && (t.Key == jaeger.AttrKey || t.Key == jaeger.AttrMessageID) {
		return "sha256:" + idHash(v) + " (--show-keys shows it)"
	}
	return v
}

// The trace pages' durations are a span's: down to the microsecond.
func init() { funcs["dur"] = spanDuration }

// spanDuration is d as a span's duration reads: 850µs, 12.3ms, 1.52s, 3m05s.
func spanDuration(d time.Duration) string {
	switch {
	case d < 0:
		return "-" + spanDuration(-d)
	case d < time.Millisecond:
		return d.Round(time.Microsecond).String()
	case d < time.Second:
		return d.Round(100 * time.Microsecond).String()
	case d < time.Minute:
		return d.Round(10 * time.Millisecond).String()
	}
	return age(d)
}
