// Package schema owns idemq's tables in Postgres: the numbered SQL
// migrations of every part (the key store, the outbox, the header keys), the
// default schema name, the check of a schema name, and the migrator.
//
// # Migrations
//
// The migrations are SQL files embedded in the package, numbered from 1
// (001_keys.sql, 002_outbox.sql, …); each is applied once, in order, into a
// Postgres schema of its own (Default unless told otherwise). Migrate
// applies the ones a schema lacks, each in its own transaction together with
// the bump of the version table <schema>.schema_version (one row, one int4
// column: the number of the last migration applied). Every step runs under
// a Postgres advisory lock, so Migrate is safe to run repeatedly and from
// several processes at once. Version reports how far a schema got.
//
// The version table is the one jackc/tern kept when it ran these
// migrations, so a schema migrated by an earlier idemq continues from where
// it stands.
package schema

import (
	"cmp"
	"fmt"
	"regexp"
)

// Default is the schema of idemq's tables when none is named.
const Default = "idemq"

var name = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// Validate checks a schema name: 1 to 63 lowercase ASCII letters, digits and
// underscores, not starting with a digit, so that the name needs no quoting
// and reads the same in SQL, in NOTIFY channels and in metrics.
func Validate(schema string) error {
	if !name.MatchString(schema) {
		return fmt.Errorf("schema %q: want lowercase letters, digits and underscores, starting with a letter or underscore", schema)
	}
	return nil
}

// resolve is schema, or Default when it is "", checked.
func resolve(schema string) (string, error) {
	schema = cmp.Or(schema, Default)
	return schema, Validate(schema)
}
