package consumer

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/internal/testdb"
)

// The savepoint an item owes goes out with its first statement once that
// statement is known on the connection; a known statement that fails when
// it runs leaves the savepoint open behind it, and rolling back to it keeps
// what the items before wrote. A statement that has not run on the
// connection (it could fail before the savepoint opens) gets a savepoint of
// its own first.
func TestSavepointRidesWithAKnownStatement(t *testing.T) {
	pool := testdb.Pool(t, 1)
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "CREATE TEMP TABLE effects (item int) ON COMMIT DROP"); err != nil {
		t.Fatal(err)
	}
	sp := &savepoints{tx: tx}
	htx := handlerTx{tx, sp}
	insert := "INSERT INTO effects VALUES ($1)"
	divide := "SELECT 1 / $1::int"

	// Item 1: its statements are new on the connection.
	sp.next()
	if _, err := htx.Exec(ctx, insert, 1); err != nil {
		t.Fatal(err)
	}
	var one int
	if err := htx.QueryRow(ctx, divide, 1).Scan(&one); err != nil {
		t.Fatal(err)
	}
	if sp.n != 1 || sp.owed {
		t.Fatalf("after item 1: savepoint %d, owed %v", sp.n, sp.owed)
	}
	for _, sql := range []string{insert, divide} {
		if !(handlerTx{tx, &savepoints{tx: tx, owed: true}}).carries(sql, []any{1}) {
			t.Fatalf("%q ran on the connection, but would not carry a savepoint", sql)
		}
	}
	// Item 2: a known statement that fails when it runs.
	sp.next()
	if err := htx.QueryRow(ctx, divide, 0).Scan(&one); err == nil {
		t.Fatal("division by zero: no error")
	}
	if sp.n != 2 || sp.owed {
		t.Fatalf("the failing statement's savepoint: %d, owed %v; want 2 opened with it", sp.n, sp.owed)
	}
	if err := sp.rollback(ctx); err != nil {
		t.Fatalf("roll back to the carried savepoint: %v", err)
	}
	// Item 3: carried by a known insert; item 4: sends nothing, fails, and
	// has nothing to roll back.
	sp.next()
	if _, err := htx.Exec(ctx, insert, 3); err != nil {
		t.Fatal(err)
	}
	sp.next()
	if err := sp.rollback(ctx); err != nil {
		t.Fatal(err)
	}
	// Item 5: an unknown statement that fails to prepare: its own
	// savepoint went first, so the transaction survives the rollback.
	sp.next()
	if _, err := htx.Exec(ctx, "INSERT INTO no_such_table VALUES ($1)", 5); err == nil {
		t.Fatal("insert into a missing table: no error")
	}
	if sp.n != 4 || sp.owed {
		t.Fatalf("the unknown statement's savepoint: %d, owed %v; want 4 opened before it", sp.n, sp.owed)
	}
	if err := sp.rollback(ctx); err != nil {
		t.Fatalf("roll back after a failed prepare: %v", err)
	}
	rows, err := tx.Query(ctx, "SELECT item FROM effects ORDER BY item")
	if err != nil {
		t.Fatal(err)
	}
	items, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		t.Fatal(err)
	}
	if len(items) != 2 || items[0] != 1 || items[1] != 3 {
		t.Fatalf("effects %v, want [1 3]", items)
	}
}
