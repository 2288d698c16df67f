package main

import (
	"context"
	"fmt"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
)

// pgKeyRepository is a durable middleware.ExpiringKeyRepository: the keys
// live in a Postgres table, shared by every process and kept across
// restarts, instead of Watermill's in-memory map. watermill-sql (v4.1.2)
// ships no such repository; this one goes through its pgx adapter
// (wsql.BeginnerFromPgx), as a Watermill user on Postgres would write it.
//
// IsDuplicate is one autocommit statement: it records the key, or takes over
// a key older than the window, and reports a duplicate when it did neither.
// Like the in-memory repository, it records the key before the handler runs
// and outside of the handler's effects: a handler that fails leaves the key
// recorded and its redelivery is dropped within the window.
type pgKeyRepository struct {
	db     wsql.ContextExecutor
	upsert string
	window time.Duration
}

func newPgKeyRepository(ctx context.Context, db wsql.ContextExecutor, schema string, window time.Duration) (*pgKeyRepository, error) {
	table := pgx.Identifier{schema, "watermill_keys"}.Sanitize()
	if _, err := db.ExecContext(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return nil, fmt.Errorf("key table: %w", err)
	}
	if _, err := db.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS "+table+" (key text PRIMARY KEY, seen_at timestamptz NOT NULL)"); err != nil {
		return nil, fmt.Errorf("key table: %w", err)
	}
	return &pgKeyRepository{
		db: db,
		upsert: `INSERT INTO ` + table + ` AS k (key, seen_at) VALUES ($1, now())
ON CONFLICT (key) DO UPDATE SET seen_at = now() WHERE k.seen_at < now() - $2::bigint * interval '1 microsecond'`,
		window: window,
	}, nil
}

// IsDuplicate implements middleware.ExpiringKeyRepository.
func (r *pgKeyRepository) IsDuplicate(ctx context.Context, key string) (bool, error) {
	res, err := r.db.ExecContext(ctx, r.upsert, key, r.window.Microseconds())
	if err != nil {
		return false, fmt.Errorf("record key: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, err
	}
	return n == 0, nil
}
