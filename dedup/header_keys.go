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
// that signs first first (keystore.Keys.HeaderKeys): secrets, the runtime's
// alone.
func (k *keys) HeaderKeys(ctx context.Context) ([]HeaderKey, error) {
	s := (*Store)(k)
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
