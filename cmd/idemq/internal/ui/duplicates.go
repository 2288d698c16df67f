package ui

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/idemq/idemq/cmd/idemq/internal/jaeger"
)

// Bounds of what the Duplicates page reads from Jaeger.
const (
	// jaegerPageTimeout bounds all the reads of one page.
	jaegerPageTimeout = 15 * time.Second
	// dupMaxServices is the most services searched for duplicates.
	dupMaxServices = 20
	// dupDefaultLimit is how many duplicates the page lists by default,
	// the newest first; dupMaxLimit the most it lists.
	dupDefaultLimit, dupMaxLimit = 50, 500
	// dupMaxOriginals is the most original traces read for one page.
	dupMaxOriginals = 100
	// jaegerParallel is how many reads of one page run at once.
	jaegerParallel = 4
)

// dupLookbacks are the windows the page offers; the first is the default.
var dupLookbacks = []string{"1h", "15m", "6h", "24h", "48h"}

// newJaeger is the client of the Jaeger at base (nil when base is empty).
func newJaeger(base string) (*jaeger.Client, error) {
	if base == "" {
		return nil, nil
	}
	return jaeger.New(base, nil)
}

type duplicatesView struct {
	// JaegerURL is the Jaeger read ("" when none was given).
	JaegerURL string
	// HasUI: the Jaeger serves its own UI, so its links open something.
	HasUI bool
	// Err is why nothing could be read; Notes what could not be read.
	Err   string
	Notes []string
	// The form: the window, the service searched ("" for all).
	Lookback, Service string
	Lookbacks         []string
	Services          []string
	Limit             int
	// Scopes are the duplicates by consumer scope, by name.
	Scopes []dupScope
	// Count is the duplicates listed; Truncated: there were more.
	Count     int
	Truncated bool
	ShowKeys  bool
	Now       time.Time
}

type dupScope struct {
	Consumer string
	Rows     []dupRow
}

// dupRow is one suppressed duplicate and what is known of the processing
// it duplicated.
type dupRow struct {
	At                       time.Time
	KeyHash, Tenant, Key     string
	Name, Service            string
	TraceID, SpanID          string
	OrigTrace, OrigSpan      string
	SameTrace                bool
	OrigOutcome, OrigMissing string
	OrigCompleted            time.Time
	// After is how long after the original completed the duplicate came.
	After time.Duration
	// JaegerDup and JaegerOrig link the two traces into Jaeger's own UI.
	JaegerDup, JaegerOrig string
}

// duplicates lists the recent suppressed duplicates Jaeger holds, per
// consumer scope, each with its trace and the trace of the processing it
// duplicated. A Jaeger that does not answer is a line on the page.
func (s *Server) duplicates(w http.ResponseWriter, r *http.Request) {
	v := duplicatesView{JaegerURL: s.cfg.JaegerURL, Lookbacks: dupLookbacks, ShowKeys: s.cfg.ShowKeys, Now: time.Now(),
		Lookback: dupLookbacks[0], Service: r.FormValue("service"), Limit: dupDefaultLimit}
	if lb := r.FormValue("lookback"); slices.Contains(dupLookbacks, lb) {
		v.Lookback = lb
	}
	if n, err := strconv.Atoi(r.FormValue("limit")); err == nil && n > 0 {
		v.Limit = min(n, dupMaxLimit)
	}
	if s.jaeger == nil {
		s.render(w, r, http.StatusOK, "duplicates", "Duplicates", v)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), jaegerPageTimeout)
	defer cancel()
	code := http.StatusOK
	if err := s.readDuplicates(ctx, &v); err != nil {
		v.Err, code = errText(err), http.StatusBadGateway
	}
	s.render(w, r, code, "duplicates", "Duplicates", v)
}

func (s *Server) readDuplicates(ctx context.Context, v *duplicatesView) error {
	j := s.jaeger
	v.HasUI, _ = j.HasUI(ctx)
	all, err := j.Services(ctx)
	if err != nil {
		return err
	}
	slices.Sort(all)
	v.Services = all
	search := all
	if v.Service != "" {
		if !slices.Contains(all, v.Service) {
			v.Notes = append(v.Notes, fmt.Sprintf("Jaeger holds no spans of service %q", v.Service))
			return nil
		}
		search = []string{v.Service}
	}
	if len(search) > dupMaxServices {
		v.Notes = append(v.Notes, fmt.Sprintf("%d services: only the first %d searched (choose one)", len(search), dupMaxServices))
		search = search[:dupMaxServices]
	}
	window, _ := time.ParseDuration(v.Lookback)
	end := time.Now()
	found := make([][]*jaeger.Trace, len(search))
	errs := make([]error, len(search))
	each(len(search), func(i int) {
		found[i], errs[i] = j.Find(ctx, jaeger.Query{
			Service: search[i], Tags: jaeger.DuplicateTags(), Start: end.Add(-window), End: end, Limit: v.Limit,
		})
	})
	var dups []jaeger.Duplicate
	seen := map[string]bool{}
	failed := 0
	for i, traces := range found {
		if errs[i] != nil {
			failed++
			v.Notes = append(v.Notes, errText(errs[i]))
		}
		for _, t := range traces {
			for _, d := range t.Duplicates() {
				if id := d.Span.TraceID + "/" + d.Span.SpanID; !seen[id] {
					seen[id] = true
					dups = append(dups, d)
				}
			}
		}
	}
	if failed == len(search) && failed > 0 {
		return errs[0]
	}
	slices.SortStableFunc(dups, func(a, b jaeger.Duplicate) int { return b.Span.Start.Compare(a.Span.Start) })
	if len(dups) > v.Limit {
		dups, v.Truncated = dups[:v.Limit], true
	}
	origs := s.originals(ctx, dups)
	byScope := map[string]*dupScope{}
	for _, d := range dups {
		row := dupRow{
			At: d.Span.Start, KeyHash: d.KeyHash, Tenant: d.Tenant, Name: d.Span.Name, Service: d.Span.Service,
			TraceID: d.Span.TraceID, SpanID: d.Span.SpanID, OrigTrace: d.OriginalTrace, OrigSpan: d.OriginalSpan,
			SameTrace: d.OriginalTrace == d.Span.TraceID, OrigCompleted: d.OriginalCompleted,
		}
		if s.cfg.ShowKeys {
			row.Key, _ = d.Span.Tag(jaeger.AttrKey)
		}
		if v.HasUI {
			row.JaegerDup = j.UITraceURL(row.TraceID)
			if row.OrigTrace != "" {
				row.JaegerOrig = j.UITraceURL(row.OrigTrace)
			}
		}
		switch o := origs[row.OrigTrace]; {
		case row.OrigTrace == "":
			row.OrigMissing = "the key row stores no trace of its first processing"
		case o.err != nil:
			row.OrigMissing = o.err.Error()
		case o.trace != nil:
			if sp := o.trace.Span(row.OrigSpan); sp != nil {
				row.OrigOutcome, _ = sp.Tag(jaeger.AttrOutcome)
				if row.OrigCompleted.IsZero() {
					row.OrigCompleted = sp.End()
				}
			} else {
				row.OrigMissing = "its span is not in Jaeger (a worker killed before it exported its spans?)"
			}
		default:
			row.OrigMissing = "not read (too many originals on one page)"
		}
		if !row.OrigCompleted.IsZero() {
			row.After = row.At.Sub(row.OrigCompleted)
		}
		scope := cmp.Or(d.Consumer, "(no consumer scope on the span)")
		if byScope[scope] == nil {
			byScope[scope] = &dupScope{Consumer: scope}
		}
		byScope[scope].Rows = append(byScope[scope].Rows, row)
		v.Count++
	}
	for _, name := range slices.Sorted(maps.Keys(byScope)) {
		v.Scopes = append(v.Scopes, *byScope[name])
	}
	return nil
}

// original is an original processing's trace as read for a page.
type original struct {
	trace *jaeger.Trace
	err   error
}

// originals reads the traces the duplicates link to, at most
// dupMaxOriginals of them.
func (s *Server) originals(ctx context.Context, dups []jaeger.Duplicate) map[string]original {
	var ids []string
	for _, d := range dups {
		if id := d.OriginalTrace; id != "" && !slices.Contains(ids, id) && len(ids) < dupMaxOriginals {
			ids = append(ids, id)
		}
	}
	got := make([]original, len(ids))
	each(len(ids), func(i int) {
		t, err := s.jaeger.Trace(ctx, ids[i])
		switch {
		case errors.Is(err, jaeger.ErrNotFound):
			err = errors.New("its trace is not in Jaeger (not sampled, not exported, or past Jaeger's retention)")
		case err != nil:
			err = fmt.Errorf("its trace could not be read: %s", errText(err))
		}
		got[i] = original{trace: t, err: err}
	})
	out := map[string]original{}
	for i, id := range ids {
		out[id] = got[i]
	}
	return out
}

// each runs fn(0) … fn(n-1), jaegerParallel at a time, and waits for them.
func each(n int, fn func(i int)) {
	var wg sync.WaitGroup
	sem := make(chan struct{}, jaegerParallel)
	for i := range n {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			fn(i)
		})
	}
	wg.Wait()
}
