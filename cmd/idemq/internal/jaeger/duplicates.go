package jaeger

import (
	"time"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/duptrace"
)

// The attributes idemq writes on the span of a delivery (consumer) or a
// guarded request (dedup/idemhttp), and on a duplicate's event
// (internal/duptrace).
const (
	AttrOutcome  = "idemq.outcome"
	AttrConsumer = "idemq.consumer"
	AttrTenant   = "idemq.tenant"
	AttrKeyHash  = "idemq.key_hash"
	// AttrKey is the raw key, written only when the operator opts in
	// (consumer.Config.LogKeys).
	AttrKey = "idemq.key"
	// AttrMessageID is the message's id, often the key itself.
	AttrMessageID = "messaging.message.id"
	// AttrOriginalTrace and AttrOriginalCompleted are the attributes of
	// a duplicate's event: the trace that first processed its key and
	// when that processing completed.
	AttrOriginalTrace     = "idemq.original.trace_id"
	AttrOriginalCompleted = "idemq.original.completed_at"
)

// DuplicateTags are the tags of a search for suppressed duplicates.
func DuplicateTags() map[string]string {
	return map[string]string{AttrOutcome: string(dedup.OutcomeDuplicate)}
}

// Duplicate is a suppressed duplicate as its span shows it.
type Duplicate struct {
	// Span is the duplicate's span (idemq.outcome = duplicate).
	Span *Span
	// Consumer, Tenant and KeyHash are its scope (KeyHash the key's short
	// hash, never the key).
	Consumer, Tenant, KeyHash string
	// OriginalTrace and OriginalSpan name the span that first processed
	// the key: the duplicate's link (a FOLLOWS_FROM reference), else the
	// trace id its event carries (OriginalSpan then "").
	OriginalTrace, OriginalSpan string
	// OriginalCompleted is when the original processing completed, as
	// the key row says (zero when unknown).
	OriginalCompleted time.Time
}

// Duplicates returns the suppressed duplicates among t's spans.
func (t *Trace) Duplicates() []Duplicate {
	var out []Duplicate
	for i := range t.Spans {
		s := &t.Spans[i]
		if o, _ := s.Tag(AttrOutcome); o != string(dedup.OutcomeDuplicate) {
			continue
		}
		d := Duplicate{Span: s}
		d.Consumer, _ = s.Tag(AttrConsumer)
		d.Tenant, _ = s.Tag(AttrTenant)
		d.KeyHash, _ = s.Tag(AttrKeyHash)
		for _, r := range s.Refs {
			if r.Type == FollowsFrom {
				d.OriginalTrace, d.OriginalSpan = r.TraceID, r.SpanID
				break
			}
		}
		for _, ev := range s.Events {
			if ev.Name != duptrace.Event {
				continue
			}
			if d.OriginalTrace == "" {
				if v, ok := ev.Tag(AttrOriginalTrace); ok {
					d.OriginalTrace, _ = NormalizeTraceID(v)
				}
			}
			if v, ok := ev.Tag(AttrOriginalCompleted); ok {
				d.OriginalCompleted, _ = time.Parse(time.RFC3339Nano, v)
			}
		}
		out = append(out, d)
	}
	return out
}
