package ui

import (
	"context"
	"errors"
	"net/http"
	"time"

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
