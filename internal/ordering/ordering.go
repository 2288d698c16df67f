// Package ordering owns the rows that keep an entity's messages in order:
// the last sequence applied per (consumer, tenant, ordering key), which
// advances in the effect's transaction, the keys blocked by a dead letter,
// and the operators' skips (the tables of migration 010_ordering). The
// consumer advances and blocks; `idemq order` reads and skips.
package ordering

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The headers of ordered messages (DESIGN section 12), the publishers' own
// claims: the consumer reads them (internal/wire), the outbox's relay
// writes them.
const (
	HeaderKey      = "x-ordering-key"
	HeaderSequence = "x-sequence"
)

// Verdict is what a message's sequence is to its key's last applied one.
type Verdict int

const (
	// Next: the sequence follows the last applied one; it runs, and the row
	// now says it is applied (in the caller's transaction).
	Next Verdict = iota
	// Applied: the sequence is at or below the last applied one (a
	// duplicate of what took effect).
	Applied
	// Early: a sequence before it is not applied yet; it must wait.
	Early
)

// Querier is a transaction or a pool: what the statements run on.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Scope names one ordering key's row.
type Scope struct {
	Consumer, Tenant, Key string
}

// Advance compares seq with the key's last applied sequence, in tx, and
// when seq is the next one records it as applied (clearing a block). It
// returns the verdict and the last sequence applied before. The row stays
// locked until tx ends, so that two transactions of one key never decide
// at once.
func Advance(ctx context.Context, tx Querier, schema string, s Scope, seq int64) (Verdict, int64, error) {
	var last int64
	err := tx.QueryRow(ctx, `INSERT INTO `+schema+`.ordering_keys AS o (consumer, tenant, ordering_key, last_sequence)
VALUES ($1, $2, $3, CASE WHEN $4::bigint = 1 THEN 1 ELSE 0 END)
ON CONFLICT (consumer, tenant, ordering_key) DO UPDATE SET
	seen_sequence = o.last_sequence,
	last_sequence = CASE WHEN o.last_sequence + 1 = $4 THEN $4 ELSE o.last_sequence END,
	blocked_at = CASE WHEN o.last_sequence + 1 = $4 THEN NULL ELSE o.blocked_at END,
	blocked_reason = CASE WHEN o.last_sequence + 1 = $4 THEN NULL ELSE o.blocked_reason END,
	blocked_sequence = CASE WHEN o.last_sequence + 1 = $4 THEN NULL ELSE o.blocked_sequence END,
	updated_at = now()
RETURNING seen_sequence`, s.Consumer, s.Tenant, s.Key, seq).Scan(&last)
	if err != nil {
		return 0, 0, fmt.Errorf("advance ordering key: %w", err)
	}
	switch {
	case seq == last+1:
		return Next, last, nil
	case seq <= last:
		return Applied, last, nil
	}
	return Early, last, nil
}

// Block marks the key blocked at seq for reason (a dead letter's), unless
// seq is applied by now. A key already blocked keeps its first block.
func Block(ctx context.Context, db Querier, schema string, s Scope, seq int64, reason string) error {
	_, err := db.Exec(ctx, `INSERT INTO `+schema+`.ordering_keys AS o (consumer, tenant, ordering_key, blocked_at, blocked_reason, blocked_sequence)
VALUES ($1, $2, $3, now(), $5, $4)
ON CONFLICT (consumer, tenant, ordering_key) DO UPDATE SET
	blocked_at = COALESCE(o.blocked_at, now()),
	blocked_reason = COALESCE(o.blocked_reason, $5),
	blocked_sequence = COALESCE(o.blocked_sequence, $4),
	updated_at = now()
WHERE o.last_sequence < $4`, s.Consumer, s.Tenant, s.Key, seq, reason)
	if err != nil {
		return fmt.Errorf("block ordering key: %w", err)
	}
	return nil
}

// Key is one ordering key's row as `idemq order status` shows it.
type Key struct {
	Scope
	LastSequence int64
	UpdatedAt    time.Time
	// Blocked: BlockedAt is set; BlockedReason and BlockedSequence say by
	// which dead letter.
	BlockedAt       *time.Time
	BlockedReason   string
	BlockedSequence int64
}

// Blocked lists the blocked keys of consumer ("" every consumer), longest
// blocked first, at most limit.
func Blocked(ctx context.Context, db Querier, schema, consumer string, limit int) ([]Key, error) {
	rows, err := db.Query(ctx, `SELECT consumer, tenant, ordering_key, last_sequence, updated_at, blocked_at, blocked_reason, blocked_sequence
FROM `+schema+`.ordering_keys
WHERE blocked_at IS NOT NULL AND ($1 = '' OR consumer = $1)
ORDER BY blocked_at LIMIT $2`, consumer, limit)
	if err != nil {
		return nil, fmt.Errorf("list blocked ordering keys: %w", err)
	}
	defer rows.Close()
	var out []Key
	for rows.Next() {
		var k Key
		var reason *string
		var seq *int64
		if err := rows.Scan(&k.Consumer, &k.Tenant, &k.Key, &k.LastSequence, &k.UpdatedAt, &k.BlockedAt, &reason, &seq); err != nil {
			return nil, fmt.Errorf("list blocked ordering keys: %w", err)
		}
		if reason != nil {
			k.BlockedReason = *reason
		}
		if seq != nil {
			k.BlockedSequence = *seq
		}
		out = append(out, k)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list blocked ordering keys: %w", err)
	}
	return out, nil
}

// Get reads one key's row; ok false when the key has none (nothing applied).
func Get(ctx context.Context, db Querier, schema string, s Scope) (k Key, ok bool, err error) {
	var reason *string
	var seq *int64
	k.Scope = s
	err = db.QueryRow(ctx, `SELECT last_sequence, updated_at, blocked_at, blocked_reason, blocked_sequence
FROM `+schema+`.ordering_keys WHERE consumer = $1 AND tenant = $2 AND ordering_key = $3`,
		s.Consumer, s.Tenant, s.Key).Scan(&k.LastSequence, &k.UpdatedAt, &k.BlockedAt, &reason, &seq)
	if errors.Is(err, pgx.ErrNoRows) {
		return k, false, nil
	}
	if err != nil {
		return k, false, fmt.Errorf("read ordering key: %w", err)
	}
	if reason != nil {
		k.BlockedReason = *reason
	}
	if seq != nil {
		k.BlockedSequence = *seq
	}
	return k, true, nil
}

// ErrSkipBackwards: a skip may only move a key forward (or leave it where
// it is to unblock it): what was applied cannot be unapplied.
var ErrSkipBackwards = errors.New("a skip cannot go below the last applied sequence")

// Skip sets the key's last applied sequence to to and clears its block, in
// one transaction with the record of who did it (operator) and why (note).
// It returns the last applied sequence before.
func Skip(ctx context.Context, db interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}, schema string, s Scope, to int64, operator, note string) (from int64, err error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("skip: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, `INSERT INTO `+schema+`.ordering_keys (consumer, tenant, ordering_key) VALUES ($1, $2, $3)
ON CONFLICT DO NOTHING`, s.Consumer, s.Tenant, s.Key); err != nil {
		return 0, fmt.Errorf("skip: %w", err)
	}
	if err := tx.QueryRow(ctx, `SELECT last_sequence FROM `+schema+`.ordering_keys
WHERE consumer = $1 AND tenant = $2 AND ordering_key = $3 FOR UPDATE`, s.Consumer, s.Tenant, s.Key).Scan(&from); err != nil {
		return 0, fmt.Errorf("skip: %w", err)
	}
	if to < from {
		return from, fmt.Errorf("skip to %d: %w (%d)", to, ErrSkipBackwards, from)
	}
	if _, err := tx.Exec(ctx, `UPDATE `+schema+`.ordering_keys SET last_sequence = $4, seen_sequence = $4,
	blocked_at = NULL, blocked_reason = NULL, blocked_sequence = NULL, updated_at = now()
WHERE consumer = $1 AND tenant = $2 AND ordering_key = $3`, s.Consumer, s.Tenant, s.Key, to); err != nil {
		return 0, fmt.Errorf("skip: %w", err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+schema+`.ordering_skips (consumer, tenant, ordering_key, from_sequence, to_sequence, operator, note)
VALUES ($1, $2, $3, $4, $5, $6, $7)`, s.Consumer, s.Tenant, s.Key, from, to, operator, note); err != nil {
		return 0, fmt.Errorf("skip: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("skip: %w", err)
	}
	return from, nil
}
