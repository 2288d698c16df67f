// Package keys looks up one idempotency key and describes its row: what
// `idemq keys inspect` prints and the UI's key lookup shows.
package keys

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/idemq/idemq/dedup"
)

// Report is the description of a key's row (also `keys inspect --json`).
// Every field is always in the JSON, empty or null when the row has no
// value: docs/cli.md lists them, and a test holds the two together.
type Report struct {
	Consumer string `json:"consumer"`
	Tenant   string `json:"tenant"`
	KeyHash  string `json:"key_hash"`
	Hashed   bool   `json:"hashed"`
	// State is in_progress, released or completed (see StateOf).
	State string `json:"state"`
	// ReleaseReason says why a released key was given up.
	ReleaseReason  string     `json:"release_reason"`
	Attempts       int        `json:"attempts"`
	LockedUntil    *time.Time `json:"locked_until"`
	LeaseValid     bool       `json:"lease_valid"`
	Outcome        string     `json:"outcome"`
	ResponseCode   *int       `json:"response_code"`
	ResponseReason string     `json:"response_reason"`
	ResponseSize   *int       `json:"response_size"`
	// ResponseHeaders names the headers of a stored HTTP answer.
	ResponseHeaders []string   `json:"response_headers,omitempty"`
	RecoveryPoint   string     `json:"recovery_point"`
	RecoveryDataSz  int        `json:"recovery_data_size"`
	Steps           []string   `json:"steps"`
	Fingerprint     string     `json:"fingerprint"`
	TraceID         string     `json:"trace_id"`
	SpanID          string     `json:"span_id"`
	TraceURL        string     `json:"trace_url"`
	CreatedAt       time.Time  `json:"created_at"`
	UpdatedAt       time.Time  `json:"updated_at"`
	CompletedAt     *time.Time `json:"completed_at"`
	// UITraceURL is the trace's page on an idemq UI (`idemq ui`, whose
	// base URL the caller knows: keys inspect's --ui-url); "" otherwise.
	UITraceURL string `json:"ui_trace_url"`
}

// StateReleased is how a report shows an in-progress row whose holder gave
// it up (dedup.Record.Released): no worker holds it, and the next delivery
// of the key takes it over.
const StateReleased = "released"

// StateOf is the state a report shows: the row's, or released.
func StateOf(rec *dedup.Record) string {
	if rec.Released {
		return StateReleased
	}
	return string(rec.State)
}

// ErrNotFound means the key has no row in the scope looked in; the error
// Lookup returns wraps it and names the scope.
var ErrNotFound = dedup.ErrNotFound

// Lookup reads the row of scope's key from store and describes it, with
// the first processing's trace linked into the Jaeger UI at jaegerURL (none
// when empty). A key with no row is an error that wraps ErrNotFound.
func Lookup(ctx context.Context, store *dedup.Store, scope dedup.Scope, jaegerURL string) (Report, *dedup.Record, error) {
	rec, err := store.Inspect(ctx, scope)
	if errors.Is(err, dedup.ErrNotFound) {
		return Report{}, nil, notFound(scope.Consumer, scope.Tenant)
	}
	if err != nil {
		return Report{}, nil, err
	}
	return NewReport(rec, scope.KeyHash(), store.Config().HashKeys, jaegerURL), rec, nil
}

// NewReport describes rec, whose scoped key hashes to keyHash.
func NewReport(rec *dedup.Record, keyHash string, hashed bool, jaegerURL string) Report {
	r := Report{
		Consumer:       rec.Consumer,
		Tenant:         rec.Tenant,
		KeyHash:        keyHash,
		Hashed:         hashed,
		State:          StateOf(rec),
		ReleaseReason:  rec.ReleaseReason,
		Attempts:       rec.Attempts,
		LockedUntil:    rec.LockedUntil,
		LeaseValid:     rec.LeaseValid,
		RecoveryPoint:  rec.RecoveryPoint,
		Steps:          rec.Steps,
		Fingerprint:    rec.Fingerprint.String(),
		TraceID:        rec.TraceID,
		SpanID:         rec.SpanID,
		CreatedAt:      rec.CreatedAt,
		UpdatedAt:      rec.UpdatedAt,
		CompletedAt:    rec.CompletedAt,
		RecoveryDataSz: len(rec.RecoveryData),
	}
	if r.Steps == nil {
		r.Steps = []string{}
	}
	if rec.Result != nil {
		r.Outcome, r.ResponseReason = string(rec.Result.Outcome), rec.Result.Reason
		code, size := rec.Result.Code, len(rec.Result.Response)
		r.ResponseCode, r.ResponseSize = &code, &size
		r.ResponseHeaders = slices.Sorted(maps.Keys(rec.Result.Headers))
	}
	if strings.Trim(r.TraceID, "0") == "" {
		// No tracer was installed when the key was first processed.
		r.TraceID, r.SpanID = "", ""
	}
	if jaegerURL != "" && r.TraceID != "" {
		r.TraceURL = strings.TrimRight(jaegerURL, "/") + "/trace/" + r.TraceID
	}
	return r
}

// notFound is the error of a key with no row, naming the scope looked in.
func notFound(consumer, tenant string) error {
	return &notFoundError{consumer, tenant}
}

type notFoundError struct{ consumer, tenant string }

func (e *notFoundError) Error() string {
	if e.tenant == "" {
		return fmt.Sprintf("key not found (consumer %q, default tenant)", e.consumer)
	}
	return fmt.Sprintf("key not found (consumer %q, tenant %q)", e.consumer, e.tenant)
}

func (e *notFoundError) Unwrap() error { return ErrNotFound }
