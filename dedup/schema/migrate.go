package schema

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"regexp"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

//go:embed migrations/*.sql
var files embed.FS

// lockKey is the advisory lock every migration step holds. It is the key
// under which earlier idemq versions ran their whole migration, so that a
// process of an earlier version and one of this version never migrate a
// schema at the same time.
const lockKey = int64(0x1de3_0001)

const (
	// placeholder stands for the schema's quoted identifier in the files.
	placeholder = "{{.schema}}"
	// downMarker ends the part of a file that Migrate applies; what follows
	// it is the SQL that undoes the migration, for an operator to run by hand.
	downMarker = "---- create above / drop below ----"
)

// migration is one numbered file.
type migration struct {
	version int
	name    string
	sql     string // the up part, with placeholder still in it
}

var fileName = regexp.MustCompile(`^([0-9]+)_[a-z0-9_]+\.sql$`)

// migrations are the embedded files in version order, checked once.
var migrations, migrationsErr = load(files)

// load reads the migrations of fsys ("migrations/*.sql"): numbered from 1
// with no gap, each with an up part.
func load(fsys fs.FS) ([]migration, error) {
	entries, err := fs.ReadDir(fsys, "migrations")
	if err != nil {
		return nil, fmt.Errorf("read migrations: %w", err)
	}
	var out []migration
	for _, e := range entries {
		m := fileName.FindStringSubmatch(e.Name())
		if m == nil {
			return nil, fmt.Errorf("migration file %s: want NNN_name.sql", e.Name())
		}
		v, _ := strconv.Atoi(m[1])
		if v != len(out)+1 {
			return nil, fmt.Errorf("migration file %s: want version %d next", e.Name(), len(out)+1)
		}
		b, err := fs.ReadFile(fsys, "migrations/"+e.Name())
		if err != nil {
			return nil, fmt.Errorf("read migration %s: %w", e.Name(), err)
		}
		up, _, _ := strings.Cut(string(b), downMarker)
		if strings.Contains(strings.ReplaceAll(up, placeholder, ""), "{{") {
			return nil, fmt.Errorf("migration %s: a placeholder other than %s", e.Name(), placeholder)
		}
		if strings.TrimSpace(up) == "" {
			return nil, fmt.Errorf("migration %s: no SQL to apply", e.Name())
		}
		out = append(out, migration{version: v, name: e.Name(), sql: up})
	}
	return out, nil
}

// Migrate creates or upgrades the tables of every idemq part (keys, outbox,
// header keys) in schema ("" means Default). It applies each migration the
// schema lacks in a transaction of its own that also records its number in
// <schema>.schema_version, and holds an advisory lock in each, so it is safe
// to run repeatedly and from several processes at once: a schema already up
// to date is left alone, and one newer than this build (a later idemq
// migrated it) too. It needs a role that may create the schema (or owns
// it) and its tables; see docs/security.md.
func Migrate(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	return MigrateTo(ctx, pool, schema, len(migrations))
}

// MigrateTo is Migrate up to migration version and no further, for an
// upgrade in stages (and for tests of one): a schema at or past version is
// left alone.
func MigrateTo(ctx context.Context, pool *pgxpool.Pool, schema string, version int) error {
	schema, err := resolve(schema)
	if err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	if migrationsErr != nil {
		return fmt.Errorf("migrate: %w", migrationsErr)
	}
	if version < 0 || version > len(migrations) {
		return fmt.Errorf("migrate: version %d: this build knows versions 0 to %d", version, len(migrations))
	}
	return migrate(ctx, pool, schema, migrations[:version])
}

// migrate applies ms to schema, one step per transaction, until none is left.
func migrate(ctx context.Context, pool *pgxpool.Pool, schema string, ms []migration) error {
	for {
		done, err := step(ctx, pool, schema, ms)
		if err != nil {
			return fmt.Errorf("migrate schema %s: %w", schema, err)
		}
		if done {
			return nil
		}
	}
}

// step applies the next migration schema lacks in one transaction, under
// the advisory lock; done reports that none was left.
func step(ctx context.Context, pool *pgxpool.Pool, schema string, ms []migration) (done bool, err error) {
	ident := pgx.Identifier{schema}.Sanitize()
	table := ident + ".schema_version"
	// Read committed, whatever the server's default: the statements after
	// the lock must see what the holder before committed.
	err = pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", lockKey); err != nil {
			return fmt.Errorf("lock: %w", err)
		}
		if err := ensureSchema(ctx, tx, schema); err != nil {
			return err
		}
		applied, err := ensureVersionTable(ctx, tx, schema, table)
		if err != nil {
			return err
		}
		if applied >= len(ms) {
			done = true
			return nil
		}
		m := ms[applied]
		if _, err := tx.Exec(ctx, strings.ReplaceAll(m.sql, placeholder, ident)); err != nil {
			return fmt.Errorf("apply %s: %w", m.name, err)
		}
		tag, err := tx.Exec(ctx, "UPDATE "+table+" SET version = $1 WHERE version = $2", m.version, applied)
		if err != nil {
			return fmt.Errorf("record version %d: %w", m.version, err)
		}
		if tag.RowsAffected() != 1 {
			return fmt.Errorf("record version %d: %s changed while locked", m.version, table)
		}
		return nil
	})
	return done, err
}

// ensureSchema creates schema when it does not exist, and otherwise checks
// that the current role may create tables in it: a role that may not (a
// worker's) cannot migrate, even a schema already up to date. Run under the
// lock: CREATE SCHEMA IF NOT EXISTS run twice at once can fail (a unique
// violation on pg_namespace).
func ensureSchema(ctx context.Context, tx pgx.Tx, schema string) error {
	var mayCreate bool
	err := tx.QueryRow(ctx, "SELECT has_schema_privilege(oid, 'CREATE') FROM pg_catalog.pg_namespace WHERE nspname = $1", schema).Scan(&mayCreate)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		if _, err := tx.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{schema}.Sanitize()); err != nil {
			return fmt.Errorf("create schema: %w", err)
		}
		return nil
	case err != nil:
		return fmt.Errorf("find schema: %w", err)
	case !mayCreate:
		return errors.New("the role may not create tables in the schema: run migrations as its owner (see docs/security.md)")
	}
	return nil
}

// ensureVersionTable creates the version table with its one row (version 0)
// when it does not exist yet, as jackc/tern did, and returns the version.
func ensureVersionTable(ctx context.Context, tx pgx.Tx, schema, table string) (int, error) {
	var exists bool
	if err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_tables WHERE schemaname = $1 AND tablename = 'schema_version')",
		schema).Scan(&exists); err != nil {
		return 0, fmt.Errorf("find version table: %w", err)
	}
	if !exists {
		if _, err := tx.Exec(ctx, "CREATE TABLE "+table+" (version int4 NOT NULL)"); err != nil {
			return 0, fmt.Errorf("create version table: %w", err)
		}
	}
	if _, err := tx.Exec(ctx, "INSERT INTO "+table+" (version) SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM "+table+")"); err != nil {
		return 0, fmt.Errorf("init version table: %w", err)
	}
	var v int32
	if err := tx.QueryRow(ctx, "SELECT version FROM "+table).Scan(&v); err != nil {
		return 0, fmt.Errorf("read version: %w", err)
	}
	if v < 0 {
		return 0, fmt.Errorf("read version: %s holds version %d", table, v)
	}
	return int(v), nil
}

// Version reports the number of the last migration applied to schema (""
// means Default), 0 when it was never migrated (no version table), and the
// number of the last migration this build knows: applied < known means the
// schema needs Migrate, applied > known that a later idemq migrated it.
func Version(ctx context.Context, pool *pgxpool.Pool, schema string) (applied, known int, err error) {
	schema, err = resolve(schema)
	if err != nil {
		return 0, 0, fmt.Errorf("schema version: %w", err)
	}
	if migrationsErr != nil {
		return 0, 0, fmt.Errorf("schema version: %w", migrationsErr)
	}
	known = len(migrations)
	var v int32
	err = pool.QueryRow(ctx, "SELECT version FROM "+pgx.Identifier{schema, "schema_version"}.Sanitize()).Scan(&v)
	var pgErr *pgconn.PgError
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return 0, known, nil
	// undefined_table, invalid_schema_name: never migrated.
	case errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "3F000"):
		return 0, known, nil
	case err != nil:
		return 0, known, fmt.Errorf("schema version of %s: %w", schema, err)
	}
	return int(v), known, nil
}

// ErrNotMigrated means a schema lacks migrations this build needs: run
// Migrate (or `idemq migrate`).
var ErrNotMigrated = errors.New("the schema is not migrated")

// Check reports whether schema ("" means Default) is migrated as far as
// this build needs: a schema never migrated, or one an older idemq left
// behind, is an error wrapping ErrNotMigrated that says to run `idemq
// migrate`; a schema a later idemq migrated further is accepted.
func Check(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	applied, known, err := Version(ctx, pool, schema)
	if err != nil {
		return err
	}
	schema, _ = resolve(schema)
	switch {
	case applied == 0:
		return fmt.Errorf("schema %s: %w: run `idemq migrate --schema %s` (or schema.Migrate)", schema, ErrNotMigrated, schema)
	case applied < known:
		return fmt.Errorf("schema %s is at version %d, this build needs %d: %w: run `idemq migrate --schema %s` (or schema.Migrate)",
			schema, applied, known, ErrNotMigrated, schema)
	}
	return nil
}
