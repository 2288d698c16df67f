package schema_test

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/testdb"
)

// envMigrate names the schema a child process of TestMigrateFromConcurrentProcesses migrates.
const envMigrate = "IDEMQ_TEST_MIGRATE_SCHEMA"

// TestMain doubles as a migrating process for TestMigrateFromConcurrentProcesses.
func TestMain(m *testing.M) {
	if name := os.Getenv(envMigrate); name != "" {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		pool, err := pgxpool.New(ctx, testdb.URL())
		if err == nil {
			err = schema.Migrate(ctx, pool, name)
		}
		if err != nil {
			os.Stderr.WriteString("migrate: " + err.Error() + "\n")
			os.Exit(3)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// known is the number of migrations of this build.
func known(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	_, n, err := schema.Version(context.Background(), pool, "idemq_never_migrated")
	if err != nil || n < 5 {
		t.Fatalf("version of a schema never migrated: known %d, %v", n, err)
	}
	return n
}

// mustVersion fails unless name is at version want.
func mustVersion(t *testing.T, pool *pgxpool.Pool, name string, want int) {
	t.Helper()
	applied, _, err := schema.Version(context.Background(), pool, name)
	if err != nil || applied != want {
		t.Fatalf("schema %s at version %d (%v), want %d", name, applied, err, want)
	}
}

// count returns the rows of a table.
func count(t *testing.T, pool *pgxpool.Pool, table string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM "+table).Scan(&n); err != nil {
		t.Fatalf("count %s: %v", table, err)
	}
	return n
}

func TestMigrateFreshThenAgainIsANoOp(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, 4)
	ctx := context.Background()
	name := testdb.Schema(t, pool)
	n := known(t, pool)
	mustVersion(t, pool, name, 0)
	if err := schema.Migrate(ctx, pool, name); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	mustVersion(t, pool, name, n)
	ident := pgx.Identifier{name}.Sanitize()
	for _, table := range []string{"keys", "outbox", "header_keys"} {
		count(t, pool, ident+"."+table) // exists
	}
	if got := count(t, pool, ident+".schema_version"); got != 1 {
		t.Fatalf("schema_version has %d rows, want 1", got)
	}
	// 005 inserts a random header key: a migration that ran twice would
	// leave two.
	for range 2 {
		if err := schema.Migrate(ctx, pool, name); err != nil {
			t.Fatalf("migrate again: %v", err)
		}
	}
	mustVersion(t, pool, name, n)
	if got := count(t, pool, ident+".header_keys"); got != 1 {
		t.Fatalf("header_keys has %d rows after migrating three times, want 1", got)
	}
}

// Several goroutines, each on connections of its own pool, migrate one new
// schema at once: every call succeeds and each migration runs once.
func TestMigrateConcurrently(t *testing.T) {
	t.Parallel()
	admin := testdb.Pool(t, 2)
	name := testdb.Schema(t, admin)
	n := known(t, admin)
	const callers = 8
	pools := make([]*pgxpool.Pool, callers)
	for i := range pools {
		pools[i] = testdb.Pool(t, 2)
	}
	start := make(chan struct{})
	errs := make([]error, callers)
	var wg sync.WaitGroup
	for i, p := range pools {
		wg.Go(func() {
			<-start
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			errs[i] = schema.Migrate(ctx, p, name)
		})
	}
	close(start)
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("caller %d: %v", i, err)
		}
	}
	mustVersion(t, admin, name, n)
	if got := count(t, admin, pgx.Identifier{name}.Sanitize()+".header_keys"); got != 1 {
		t.Fatalf("header_keys has %d rows, want 1", got)
	}
}

// Five processes migrate a new schema at once.
func TestMigrateFromConcurrentProcesses(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, 2)
	name := testdb.Schema(t, pool)
	var wg sync.WaitGroup
	errs := make([]error, 5)
	outs := make([][]byte, 5)
	for i := range 5 {
		wg.Go(func() {
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), envMigrate+"="+name)
			outs[i], errs[i] = cmd.CombinedOutput()
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("process %d: %v: %s", i, err, outs[i])
		}
	}
	mustVersion(t, pool, name, known(t, pool))
}

func TestMigrateToThenOn(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, 2)
	ctx := context.Background()
	name := testdb.Schema(t, pool)
	n := known(t, pool)
	if err := schema.MigrateTo(ctx, pool, name, 2); err != nil {
		t.Fatalf("migrate to 2: %v", err)
	}
	mustVersion(t, pool, name, 2)
	// A schema past the target is left alone.
	if err := schema.MigrateTo(ctx, pool, name, 1); err != nil {
		t.Fatalf("migrate to 1 at 2: %v", err)
	}
	mustVersion(t, pool, name, 2)
	if err := schema.Migrate(ctx, pool, name); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	mustVersion(t, pool, name, n)
	for _, v := range []int{-1, n + 1} {
		if err := schema.MigrateTo(ctx, pool, name, v); err == nil {
			t.Errorf("migrate to %d succeeded", v)
		}
	}
}

// A schema migrated by a later idemq (a version this build does not know)
// is left alone, and Version says so.
func TestMigrateLeavesANewerSchemaAlone(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, 2)
	ctx := context.Background()
	name := testdb.Schema(t, pool)
	n := known(t, pool)
	if err := schema.Migrate(ctx, pool, name); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "UPDATE "+pgx.Identifier{name, "schema_version"}.Sanitize()+" SET version = $1", n+1); err != nil {
		t.Fatal(err)
	}
	if err := schema.Migrate(ctx, pool, name); err != nil {
		t.Fatalf("migrate a newer schema: %v", err)
	}
	applied, k, err := schema.Version(ctx, pool, name)
	if err != nil || applied != n+1 || k != n {
		t.Fatalf("version = %d of %d, %v; want %d of %d", applied, k, err, n+1, n)
	}
}

func TestInvalidSchemaNamesAreRefused(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, 2)
	ctx := context.Background()
	for _, bad := range []string{
		"Idemq", "1idemq", "idem-q", "idemq.keys", `x"; DROP SCHEMA public; --`, "idemq ", "ïdemq",
		strings.Repeat("a", 64),
	} {
		if err := schema.Validate(bad); err == nil {
			t.Errorf("Validate(%q) accepted it", bad)
		}
		if err := schema.Migrate(ctx, pool, bad); err == nil {
			t.Errorf("Migrate(%q) succeeded", bad)
		}
		if err := schema.MigrateTo(ctx, pool, bad, 1); err == nil {
			t.Errorf("MigrateTo(%q) succeeded", bad)
		}
		if _, _, err := schema.Version(ctx, pool, bad); err == nil {
			t.Errorf("Version(%q) succeeded", bad)
		}
	}
	for _, good := range []string{schema.Default, "_x", "payments_idemq2", strings.Repeat("a", 63)} {
		if err := schema.Validate(good); err != nil {
			t.Errorf("Validate(%q): %v", good, err)
		}
	}
	if err := schema.Validate(""); err == nil {
		t.Error(`Validate("") accepted it: "" means Default only where a function says so`)
	}
}

// Migrate and Version agree that "" is Default.
func TestEmptyNameIsTheDefaultSchema(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, 2)
	ctx := context.Background()
	if err := schema.Migrate(ctx, pool, ""); err != nil {
		t.Fatalf(`migrate "": %v`, err)
	}
	a1, k1, err1 := schema.Version(ctx, pool, "")
	a2, k2, err2 := schema.Version(ctx, pool, schema.Default)
	// The default schema of the shared test database may have been migrated
	// by a newer build (a schema newer than this build is left alone).
	if err1 != nil || err2 != nil || a1 != a2 || k1 != k2 || a1 < k1 {
		t.Fatalf(`version "" = %d of %d (%v), version %q = %d of %d (%v)`, a1, k1, err1, schema.Default, a2, k2, err2)
	}
}

// poolAs opens a pool that logs in as role (the test server trusts local
// logins).
func poolAs(t *testing.T, role string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.User = role
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// A role that owns its schema migrates it without CREATE on the database
// (docs/security.md); a role that may only use the schema cannot migrate it,
// even when it is up to date.
func TestMigrateNeedsTheSchemaOwner(t *testing.T) {
	t.Parallel()
	admin := testdb.Pool(t, 2)
	ctx := context.Background()
	name := testdb.Schema(t, admin)
	owner, worker := "idemq_t_owner_"+testdb.RandomHex(4), "idemq_t_worker_"+testdb.RandomHex(4)
	for _, r := range []string{owner, worker} {
		if _, err := admin.Exec(ctx, "CREATE ROLE "+r+" LOGIN"); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		// After the pools close and before testdb drops the schema.
		conn, err := pgx.Connect(context.Background(), testdb.URL())
		if err != nil {
			t.Logf("drop roles: %v", err)
			return
		}
		defer conn.Close(context.Background())
		for _, r := range []string{worker, owner} {
			if _, err := conn.Exec(context.Background(), "DROP OWNED BY "+r+" CASCADE; DROP ROLE "+r); err != nil {
				t.Logf("drop role %s: %v", r, err)
			}
		}
	})
	ident := pgx.Identifier{name}.Sanitize()
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+ident+" AUTHORIZATION "+owner+"; GRANT USAGE ON SCHEMA "+ident+" TO "+worker); err != nil {
		t.Fatal(err)
	}
	if err := schema.Migrate(ctx, poolAs(t, owner), name); err != nil {
		t.Fatalf("migrate as the schema's owner: %v", err)
	}
	if _, err := admin.Exec(ctx, "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "+ident+" TO "+worker); err != nil {
		t.Fatal(err)
	}
	wp := poolAs(t, worker)
	if err := schema.Migrate(ctx, wp, name); err == nil {
		t.Fatal("migrate as a worker succeeded")
	}
	if err := schema.Migrate(ctx, wp, testdb.Schema(t, admin)); err == nil {
		t.Fatal("migrate a new schema as a worker succeeded")
	}
	applied, known, err := schema.Version(ctx, wp, name)
	if err != nil || applied != known {
		t.Fatalf("version read by the worker: %d of %d, %v", applied, known, err)
	}
}
