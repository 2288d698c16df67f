// Package audit records what operators do by hand — replays of dead letters,
// unparks of outbox rows, skips of ordering keys — in Postgres (the tables
// audit and audit_keys of migration 012), from the UI and the CLI, and reads
// the record back for `idemq audit`, the UI's Audit page and a key's replay
// history.
//
// An action is recorded when it starts (Begin: result "running") and its
// entry is updated when it ends (Entry.End), so that an action whose
// process died shows as never finished. The keys of the messages an action
// moved are kept as digests (KeyDigest), never as keys.
package audit

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/user"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemq/idemq/internal/redact"
)

// Actions.
const (
	ActionReplay = "dlq.replay"
	ActionUnpark = "outbox.unpark"
	ActionSkip   = "order.skip"
)

// Where an action came from.
const (
	ViaUI  = "ui"
	ViaCLI = "cli"
)

// ResultRunning is the result of an action that has not ended (or whose
// process died before it could say).
const ResultRunning = "running"

// DB is what the package needs of a pool or a connection.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Action is what an operator starts.
type Action struct {
	// Actor is who: the UI token's name, or the OS user for the CLI.
	Actor string `json:"actor"`
	// Via is ViaUI or ViaCLI.
	Via string `json:"via"`
	// Action is one of the Action* words; Target what it acts on (a queue,
	// "outbox", a consumer); What describes it in a line.
	Action string `json:"action"`
	Target string `json:"target"`
	What   string `json:"what"`
}

// Entry is an action as recorded.
type Entry struct {
	ID int64     `json:"id"`
	At time.Time `json:"at"`
	Action
	// Count is how many messages, rows or keys it moved.
	Count int `json:"count"`
	// Result is "running" until it ends, then "ok", "interrupted" or the
	// error's text.
	Result  string     `json:"result"`
	EndedAt *time.Time `json:"ended_at"`
}

// Recorder records actions into one schema.
type Recorder struct {
	db     DB
	schema string
}

// New returns a Recorder of schema's audit tables.
func New(db DB, schema string) *Recorder { return &Recorder{db: db, schema: schema} }

// ErrNoTable means the schema lacks migration 012 (idemq migrate).
var ErrNoTable = errors.New("the store has no audit table: run idemq migrate (migration 012_audit)")

// Begin records that a starts, and returns its entry's id.
func (r *Recorder) Begin(ctx context.Context, a Action) (int64, error) {
	var id int64
	err := r.db.QueryRow(ctx, `INSERT INTO `+r.schema+`.audit (actor, via, action, target, what)
VALUES ($1, $2, $3, $4, $5) RETURNING id`, a.Actor, a.Via, a.Action, a.Target, a.What).Scan(&id)
	if err != nil {
		return 0, fmt.Errorf("audit %s: %w", a.Action, wrap(err))
	}
	return id, nil
}

// End records the end of entry id: how many it moved, its result, and the
// digests of the keys of the messages it moved.
func (r *Recorder) End(ctx context.Context, id int64, count int, result string, keyDigests []string) error {
	// One statement: the entry and its keys together, or neither.
	_, err := r.db.Exec(ctx, `WITH e AS (
	UPDATE `+r.schema+`.audit SET count = $2, result = $3, ended_at = now() WHERE id = $1 RETURNING id
)
INSERT INTO `+r.schema+`.audit_keys (audit_id, key_digest) SELECT e.id, d FROM e, unnest($4::text[]) AS d`,
		id, count, result, keyDigests)
	if err != nil {
		return fmt.Errorf("audit: end entry %d: %w", id, wrap(err))
	}
	return nil
}

// ErrInterrupted is the end of an action stopped before it was through.
var ErrInterrupted = errors.New("interrupted")

// Finish records the end of entry id as End does, its result "ok" when err
// is nil and else err's text (redacted), on a context of its own bounded by
// finishTimeout: the action is done, whatever its caller's context says.
func (r *Recorder) Finish(id int64, count int, err error, keyDigests []string) error {
	result := "ok"
	if err != nil {
		result = redact.Error(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), finishTimeout)
	defer cancel()
	return r.End(ctx, id, count, result, keyDigests)
}

// finishTimeout bounds Finish.
const finishTimeout = 10 * time.Second

// Record records an action that is done already (one statement: a skip).
func (r *Recorder) Record(ctx context.Context, a Action, count int, result string) error {
	_, err := r.db.Exec(ctx, `INSERT INTO `+r.schema+`.audit (actor, via, action, target, what, count, result, ended_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, now())`, a.Actor, a.Via, a.Action, a.Target, a.What, count, result)
	if err != nil {
		return fmt.Errorf("audit %s: %w", a.Action, wrap(err))
	}
	return nil
}

// Filter selects entries: at most Limit (0: 100), the newest first; of one
// action when Action is set; those that moved the key of KeyDigest when set.
type Filter struct {
	Action    string
	KeyDigest string
	Since     time.Time
	Limit     int
}

// List returns the entries f selects, the newest first.
func (r *Recorder) List(ctx context.Context, f Filter) ([]Entry, error) {
	if f.Limit <= 0 {
		f.Limit = 100
	}
	rows, err := r.db.Query(ctx, `SELECT id, at, actor, via, action, target, what, count, result, ended_at FROM `+r.schema+`.audit a
WHERE ($1 = '' OR action = $1)
  AND ($2 = '' OR EXISTS (SELECT FROM `+r.schema+`.audit_keys k WHERE k.audit_id = a.id AND k.key_digest = $2))
  AND at >= $3
ORDER BY at DESC, id DESC LIMIT $4`, f.Action, f.KeyDigest, f.Since, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("audit: list: %w", wrap(err))
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Entry, error) {
		var e Entry
		err := row.Scan(&e.ID, &e.At, &e.Actor, &e.Via, &e.Action.Action, &e.Target, &e.What, &e.Count, &e.Result, &e.EndedAt)
		return e, err
	})
	if err != nil {
		return nil, fmt.Errorf("audit: list: %w", wrap(err))
	}
	return out, nil
}

// KeyDigest is the digest under which the audit keeps a message's key: the
// SHA-256 of the key, hex. It is the same whatever the consumer scope, so
// that the CLI, which knows none, and the UI record the same digest.
func KeyDigest(key string) string {
	sum := sha256.Sum256([]byte(key))
	return hex.EncodeToString(sum[:])
}

// OSUser is the CLI's actor: the OS user running it ($USER when the user
// database does not know it), "unknown" when neither says.
func OSUser() string {
	if u, err := user.Current(); err == nil && u.Username != "" {
		return u.Username
	}
	if u := os.Getenv("USER"); u != "" {
		return u
	}
	return "unknown"
}

// wrap names the migration when the audit table is missing.
func wrap(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42P01" { // undefined_table
		return fmt.Errorf("%w: %w", ErrNoTable, err)
	}
	return err
}
