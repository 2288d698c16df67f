package dedup

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// HeaderKey is one key of the schema's header_keys table: an HMAC key that
// signs idemq's own message headers (see the consumer's Config.HeaderKeys).
type HeaderKey struct {
	// Secret is the key; it never appears in logs.
	Secret []byte
	// SignsFrom is when the key starts signing; it verifies at once.
	SignsFrom time.Time
}

// HeaderKeys returns the keys of the schema's header_keys table, the one
// that signs first (the latest signs_from) first. schema.Migrate creates one
// random key, so that every worker of a schema shares it without
// configuration. The error wraps ErrNotMigrated when the table does not
// exist.
func (s *Store) HeaderKeys(ctx context.Context) ([]HeaderKey, error) {
	rows, err := s.pool.Query(ctx, s.sql.headerKeys)
	if err != nil {
		return nil, interpretError("read header keys", err)
	}
	keys, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (HeaderKey, error) {
		var k HeaderKey
		err := r.Scan(&k.Secret, &k.SignsFrom)
		return k, err
	})
	if err != nil {
		return nil, interpretError("read header keys", err)
	}
	return keys, nil
}
