package ui

import (
	"context"
	"net/http"
	"time"

	"github.com/idemq/idemq/cmd/idemq/internal/audit"
)

// begin records that the operator of r starts action on target: the
// returned entry is ended with end. An action that cannot be recorded is
// not done.
func (s *Server) begin(ctx context.Context, r *http.Request, action, target, what string) (int64, error) {
	actor, _ := s.who(r)
	return s.audit.Begin(ctx, audit.Action{Actor: actor, Via: audit.ViaUI, Action: action, Target: target, What: what})
}

// end records the end of entry: count moved, err nil for "ok"; a failure to
// record it is logged (the action is done, and its entry says "running").
func (s *Server) end(entry int64, count int, err error, keyDigests []string) {
	if err := s.audit.Finish(entry, count, err, keyDigests); err != nil {
		s.log.Error("ui: audit", "entry", entry, "err", errText(err))
	}
}

type auditView struct {
	Entries []audit.Entry
	Action  string
	Err     string
}

// auditPage lists what operators did, the newest first.
func (s *Server) auditPage(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	v := auditView{Action: r.FormValue("action")}
	entries, err := s.audit.List(ctx, audit.Filter{Action: v.Action, Limit: 200})
	if err != nil {
		v.Err = errText(err)
	}
	v.Entries = entries
	s.render(w, r, http.StatusOK, "audit", "Audit", v)
}
