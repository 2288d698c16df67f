package cli

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/idemq/idemq/dedup/schema"
)

func (a *app) migrateCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "migrate",
		Short: "Create or upgrade idemq's tables in Postgres",
		Long: `Create or upgrade the tables of the key store and the outbox in the schema
given by --schema (default idemq), then print the schema version.

The migrations are embedded in the binary and applied under advisory locks with
a version table: migrate is safe to run repeatedly and from several processes at
once; a schema already up to date is left alone.`,
		Example: `  idemq migrate
  IDEMQ_POSTGRES_URL=postgres://app@db:5432/app idemq migrate --schema payments_idemq`,
		Args: noArgs,
		RunE: run(func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			pool, err := a.openPostgres(ctx, 2)
			if err != nil {
				return err
			}
			defer pool.Close()
			if err := schema.Migrate(ctx, pool, a.schema); err != nil {
				return err
			}
			applied, known, err := schema.Version(ctx, pool, a.schema)
			if err != nil {
				return err
			}
			fmt.Fprintf(a.stdout, "schema %s at version %d\n", a.schema, applied)
			if applied > known {
				a.log.Warn("the schema is newer than this idemq binary", "schema", a.schema, "applied", applied, "known", known)
			}
			return nil
		}),
	}
}
