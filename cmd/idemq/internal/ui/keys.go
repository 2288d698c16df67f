package ui

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"time"

	"github.com/idemq/idemq/cmd/idemq/internal/audit"
	"github.com/idemq/idemq/cmd/idemq/internal/dlq"
	"github.com/idemq/idemq/cmd/idemq/internal/jaeger"
	"github.com/idemq/idemq/cmd/idemq/internal/keys"
	"github.com/idemq/idemq/dedup"
)

type keyView struct {
	// Consumer, Tenant and Key are what the operator typed.
	Consumer, Tenant, Key string
	Consumers             []string
	Looked                bool
	NotFound              bool
	Err                   string
	Report                keys.Report
	Response              content
	HasResponse           bool
	Now                   time.Time
	// TracePage is the UI's page of the first processing's trace (with a Jaeger).
	TracePage string
	// Where says where the key's message is now; Replays are the replays
	// that moved a message with the key, the newest first.
	Where      []place
	Replays    []audit.Entry
	ReplaysErr string
}

// place is one answer to "where is the key's message now".
type place struct {
	// Kind is dlq, retry, handling, done or unknown.
	Kind string
	Text string
	// Link, when set, is the UI's page of it.
	Link string
}

// keyLookup shows the lookup form, and the key's row when one was asked for
// (a POST from the form keeps the key out of URLs and access logs; a GET
// with consumer and key works too, for links).
func (s *Server) keyLookup(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	v := keyView{Consumer: r.FormValue("consumer"), Tenant: r.FormValue("tenant"), Key: r.FormValue("key"), Now: time.Now()}
	if st, err := s.store.Stats(ctx); err == nil {
		for _, sc := range st {
			v.Consumers = append(v.Consumers, sc.Consumer)
		}
	}
	code := http.StatusOK
	// A link with only the consumer (the overview's) fills the form in.
	if v.Key != "" || r.Method == http.MethodPost {
		v.Looked = true
		code = s.lookup(ctx, &v)
		if code == http.StatusOK || v.NotFound {
			s.whereIs(ctx, &v)
		}
	}
	s.render(w, r, code, "keys", "Key lookup", v)
}

func (s *Server) lookup(ctx context.Context, v *keyView) int {
	if v.Consumer == "" {
		v.Err = "give the consumer whose scope holds the key"
		return http.StatusBadRequest
	}
	if err := dedup.ValidateKey(v.Key); err != nil {
		v.Err = "key: " + err.Error()
		return http.StatusBadRequest
	}
	rep, rec, err := keys.Lookup(ctx, s.store, dedup.Scope{Consumer: v.Consumer, Tenant: v.Tenant, Key: v.Key}, s.cfg.JaegerURL)
	switch {
	case errors.Is(err, keys.ErrNotFound):
		v.NotFound, v.Err = true, errText(err)
		return http.StatusNotFound
	case err != nil:
		v.Err = errText(err)
		return http.StatusBadGateway
	}
	v.Report = rep
	if s.jaeger != nil && rep.TraceID != "" {
		v.TracePage = jaeger.TracePath + "?id=" + rep.TraceID
	}
	if rec.Result != nil {
		v.HasResponse = true
		v.Response = showContent(rec.Result.Response, s.cfg.BodyLimit)
	}
	return http.StatusOK
}

// whereIs says where v's key's message is now: each dead letter with the
// key in the DLQ of a queue the consumer reads (or of one whose consumer is
// not known), and what the key's row says (waiting in a retry tier, being
// handled, done); and the replays that moved a message with the key.
func (s *Server) whereIs(ctx context.Context, v *keyView) {
	want := dedup.Scope{Consumer: v.Consumer, Tenant: v.Tenant, Key: v.Key}.KeyHash()
	var queues []Queue
	for _, name := range slices.Sorted(maps.Keys(s.queues)) {
		if q := s.queues[name]; q.Consumer == v.Consumer || q.Consumer == "" {
			queues = append(queues, q)
		}
	}
	lettered := 0
	for _, q := range queues {
		_, _, err := s.scanLetters(ctx, q, func(m dlq.Message) bool {
			if l := s.letterView(q, m); l.KeyHash == want {
				lettered++
				v.Where = append(v.Where, place{Kind: "dlq", Link: "/dlq/letter?queue=" + url.QueryEscape(q.Topology.Queue) + "&id=" + l.ID,
					Text: fmt.Sprintf("a dead letter in %s: reason %s, first seen %s", q.Topology.DLQ, l.Reason, dash(l.FirstSeen))})
			}
			return true
		})
		if err != nil {
			v.Where = append(v.Where, place{Kind: "unknown", Text: fmt.Sprintf("%s not read: %s", q.Topology.DLQ, errText(err))})
		}
	}
	rep := v.Report
	switch {
	case v.NotFound:
	case rep.State == keys.StateReleased && rep.ReleaseReason == string(dedup.OutcomeRetried):
		for _, q := range queues {
			tier := q.Topology.TierFor(max(rep.Attempts, 1))
			v.Where = append(v.Where, place{Kind: "retry", Link: "/#queue-" + q.Topology.Queue,
				Text: fmt.Sprintf("waiting in a retry tier of %s (%s, after attempt %d): it comes back to %s after the tier's delay", q.Topology.Queue, tier, rep.Attempts, q.Topology.Queue)})
		}
	case rep.State == keys.StateReleased && lettered == 0:
		v.Where = append(v.Where, place{Kind: "unknown", Text: fmt.Sprintf("given up (%s), but no dead letter with this key is in the DLQs read: replayed since, consumed by another reader, or beyond the first %d letters", dash(rep.ReleaseReason), s.cfg.LetterLimit)})
	case rep.State == string(dedup.StateInProgress) && rep.LeaseValid:
		v.Where = append(v.Where, place{Kind: "handling", Text: fmt.Sprintf("being handled now: its lease is valid until %s", rep.LockedUntil.UTC().Format(time.RFC3339))})
	case rep.State == string(dedup.StateInProgress):
		v.Where = append(v.Where, place{Kind: "handling", Text: "in progress past its lease: its worker died or lost Postgres; the next delivery takes it over"})
	case rep.State == string(dedup.StateCompleted):
		v.Where = append(v.Where, place{Kind: "done", Text: fmt.Sprintf("done: completed %s; a later copy is answered with the stored result", tsText(rep.CompletedAt))})
	}
	entries, err := s.audit.List(ctx, audit.Filter{KeyDigest: audit.KeyDigest(v.Key), Action: audit.ActionReplay, Limit: 50})
	if err != nil {
		v.ReplaysErr = errText(err)
	}
	v.Replays = entries
}

func tsText(t *time.Time) string {
	if t == nil {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}
