package dedup

import (
	"context"
	"embed"
	"fmt"
	"io/fs"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/tern/v2/migrate"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// schemaLock is the advisory lock taken while the schema itself is created;
// the migrator takes its own lock for the migrations.
const schemaLock = int64(0x1de3_0001)

// Migrate creates or upgrades the tables of every idemq part (keys, outbox)
// in the given schema ("" means DefaultSchema). It is safe to run repeatedly
// and from several processes at once: the schema is created and the numbered
// migrations are applied under advisory locks, with a version table
// (<schema>.schema_version) recording how far they got.
func Migrate(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	if schema == "" {
		schema = DefaultSchema
	}
	if err := validateSchema(schema); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("migrate: acquire connection: %w", err)
	}
	defer conn.Release()
	return MigrateConn(ctx, conn.Conn(), schema)
}

// MigrateConn is Migrate on a single connection.
func MigrateConn(ctx context.Context, conn *pgx.Conn, schema string) (err error) {
	if err := validateSchema(schema); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	ident := pgx.Identifier{schema}.Sanitize()
	// CREATE SCHEMA IF NOT EXISTS is not safe against itself running
	// concurrently (a unique violation on pg_namespace), so serialise it.
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", schemaLock); err != nil {
		return fmt.Errorf("migrate: lock: %w", err)
	}
	defer func() {
		if _, uerr := conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", schemaLock); uerr != nil && err == nil {
			err = fmt.Errorf("migrate: unlock: %w", uerr)
		}
	}()
	if _, err := conn.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+ident); err != nil {
		return fmt.Errorf("migrate: create schema: %w", err)
	}
	m, err := migrate.NewMigrator(ctx, conn, ident+".schema_version")
	if err != nil {
		return fmt.Errorf("migrate: version table: %w", err)
	}
	m.Data["schema"] = ident
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	if err := m.LoadMigrations(sub); err != nil {
		return fmt.Errorf("migrate: load: %w", err)
	}
	if err := m.Migrate(ctx); err != nil {
		return fmt.Errorf("migrate: apply: %w", err)
	}
	return nil
}

// SchemaVersion reports the highest migration applied in schema and the
// highest one this build knows.
func SchemaVersion(ctx context.Context, pool *pgxpool.Pool, schema string) (applied, known int, err error) {
	if err := validateSchema(schema); err != nil {
		return 0, 0, err
	}
	entries, err := fs.ReadDir(migrationFiles, "migrations")
	if err != nil {
		return 0, 0, err
	}
	known = len(entries)
	err = pool.QueryRow(ctx, "SELECT version FROM "+pgx.Identifier{schema}.Sanitize()+".schema_version").Scan(&applied)
	if err != nil {
		return 0, known, interpretError("schema version", err)
	}
	return applied, known, nil
}
