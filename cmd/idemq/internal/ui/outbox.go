package ui

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/idemq/idemq/cmd/idemq/internal/audit"
	"github.com/idemq/idemq/outbox"
)

// rowsShown bounds the outbox rows a page lists (pending, and parked).
const rowsShown = 1000

type outboxRow struct {
	outbox.Row
	// MessageID is the raw message_id with Config.ShowKeys, else "".
	MessageID, IDHash string
}

type outboxView struct {
	Backlog   outbox.Backlog
	Pending   []outboxRow
	Parked    []outboxRow
	Err       string
	Unparked  string
	Now       time.Time
	ShowKeys  bool
	RowsShown int
}

func (s *Server) rows(ctx context.Context, parked bool) ([]outboxRow, error) {
	rows, err := s.outbox.Rows(ctx, parked, rowsShown)
	out := make([]outboxRow, 0, len(rows))
	for _, r := range rows {
		o := outboxRow{Row: r, IDHash: idHash(r.MessageID)}
		if s.cfg.ShowKeys {
			o.MessageID = r.MessageID
		}
		o.Row.MessageID = ""
		out = append(out, o)
	}
	return out, err
}

func (s *Server) outboxPage(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	v := outboxView{Now: time.Now(), ShowKeys: s.cfg.ShowKeys, RowsShown: rowsShown, Unparked: r.FormValue("unparked")}
	var errs []error
	var err error
	if v.Backlog, err = s.outbox.Pending(ctx); err != nil {
		errs = append(errs, err)
	}
	if v.Pending, err = s.rows(ctx, false); err != nil {
		errs = append(errs, err)
	}
	if v.Parked, err = s.rows(ctx, true); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		v.Err = errText(err)
	}
	s.render(w, r, http.StatusOK, "outbox", "Outbox", v)
}

type unparkConfirmView struct {
	Rows  []outboxRow
	Token string
	All   bool
}

// chosenIDs are the row ids a form names.
func chosenIDs(values []string) ([]int64, error) {
	var ids []int64
	for _, v := range values {
		id, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("row id %q: %w", v, err)
		}
		ids = append(ids, id)
	}
	return ids, nil
}

func (s *Server) unparkConfirm(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	parked, err := s.rows(ctx, true)
	if err != nil {
		s.fail(w, r, http.StatusBadGateway, err)
		return
	}
	v := unparkConfirmView{Token: s.ops.issue(), All: r.PostForm.Get("all") != ""}
	if v.All {
		v.Rows = parked
	} else {
		ids, err := chosenIDs(r.PostForm["id"])
		if err != nil {
			s.fail(w, r, http.StatusBadRequest, err)
			return
		}
		for _, p := range parked {
			if slices.Contains(ids, p.ID) {
				v.Rows = append(v.Rows, p)
			}
		}
	}
	if len(v.Rows) == 0 {
		s.fail(w, r, http.StatusConflict, errors.New("none of the chosen rows is parked any more"))
		return
	}
	s.render(w, r, http.StatusOK, "unpark_confirm", "Unpark outbox rows?", v)
}

func (s *Server) unpark(w http.ResponseWriter, r *http.Request) {
	if _, ok := s.ops.use(r.PostForm.Get("once")); !ok {
		s.fail(w, r, http.StatusConflict, errors.New("this unpark was already submitted (or its confirmation page expired): nothing was done again"))
		return
	}
	ids, err := chosenIDs(r.PostForm["id"])
	if err != nil || len(ids) == 0 {
		s.fail(w, r, http.StatusBadRequest, errors.Join(errors.New("no rows to unpark"), err))
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	entry, err := s.begin(ctx, r, audit.ActionUnpark, "outbox", fmt.Sprintf("%d chosen parked row(s)", len(ids)))
	if err != nil {
		s.fail(w, r, http.StatusServiceUnavailable, err)
		return
	}
	n, err := s.outbox.Unpark(ctx, ids...)
	s.end(entry, int(n), err, nil)
	if err != nil {
		s.fail(w, r, http.StatusBadGateway, err)
		return
	}
	s.log.Info("ui: unparked outbox rows", "rows", n)
	http.Redirect(w, r, "/outbox?unparked="+strconv.FormatInt(n, 10), http.StatusSeeOther)
}
