package consumer

import (
	"context"
	"errors"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// maxSavepointGroup is the largest savepoint group that stays within the
// subtransactions a Postgres backend caches (PGPROC_MAX_CACHED_SUBXIDS):
// beyond it, every session's snapshots must look subtransactions up on disk
// while the group runs.
const maxSavepointGroup = 64

// savepoints is the stack of savepoints of an isolated group. Each item runs
// above a savepoint of its own, which its failure rolls back to (and which
// then serves the next item). A savepoint is opened lazily: it is owed until
// something is sent on the item's behalf, and then goes ahead of it in the
// same round trip (handlerTx, Consumer.complete). An item that sends nothing needs
// none, so a group costs no round trip for its savepoints.
type savepoints struct {
	tx pgx.Tx
	n  int // the newest savepoint opened
	// owed: the running item has no savepoint yet; the next statement sent
	// on its behalf opens savepoint n+1 first.
	owed bool
}

func (sp *savepoints) name(n int) string { return "idemq_item_" + strconv.Itoa(n) }

// next makes the next item owe its savepoint.
func (sp *savepoints) next() { sp.owed = true }

// queueOwed queues the owed savepoint on b, ahead of what b holds next.
func (sp *savepoints) queueOwed(b *pgx.Batch) {
	if sp.owed {
		b.Queue("SAVEPOINT " + sp.name(sp.n+1))
	}
}

// opened records that the owed savepoint was opened.
func (sp *savepoints) opened() {
	if sp.owed {
		sp.n, sp.owed = sp.n+1, false
	}
}

// flush opens the owed savepoint with a round trip of its own, before a
// statement that cannot carry it (a copy, a batch, a direct use of the
// connection).
func (sp *savepoints) flush(ctx context.Context) error {
	if !sp.owed {
		return nil
	}
	if _, err := sp.tx.Exec(ctx, "SAVEPOINT "+sp.name(sp.n+1)); err != nil {
		return err
	}
	sp.opened()
	return nil
}

// rollback undoes what the running item sent, if anything: back to its
// savepoint, which then serves the next item.
func (sp *savepoints) rollback(ctx context.Context) error {
	if sp.owed {
		return nil // nothing was sent on its behalf
	}
	_, err := sp.tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+sp.name(sp.n))
	return err
}

// send sends b, whose first query is the owed savepoint when one is owed,
// and reads the rest with read; the savepoint counts as opened once its
// result came back, whatever read finds.
func (sp *savepoints) send(ctx context.Context, b *pgx.Batch, read func(pgx.BatchResults) error) error {
	br := sp.tx.SendBatch(ctx, b)
	if sp.owed {
		if _, err := br.Exec(); err != nil {
			_ = br.Close()
			return err
		}
		sp.opened()
	}
	if err := read(br); err != nil {
		_ = br.Close()
		return err
	}
	return br.Close()
}

// handlerTx is the runtime's transaction as a handler sees it: the runtime
// commits it, once, after completing the keys, so that the handler's
// effects and its key's completion commit together or not at all. In an
// isolated group (sp set) the handler's first statement carries the item's
// savepoint in its round trip.
type handlerTx struct {
	pgx.Tx
	sp *savepoints
}

func (handlerTx) Commit(context.Context) error   { return ErrHandlerTx }
func (handlerTx) Rollback(context.Context) error { return ErrHandlerTx }

// carries reports whether the statement can carry the owed savepoint in a
// pgx batch: one with arguments, without a query option a batch would not
// honour (an exec mode, result formats), and one that ran on this
// connection before. A batch may prepare its statements before it runs any
// of them, and a statement that fails to prepare would abort the
// transaction before its savepoint was opened; one that was prepared before
// does not fail there. A statement without arguments runs on the simple
// protocol (it may be several statements, or name a prepared statement).
// The others go after a savepoint of their own.
func (t handlerTx) carries(sql string, args []any) bool {
	if t.sp == nil || !t.sp.owed || len(args) == 0 {
		return false
	}
	switch args[0].(type) {
	case pgx.QueryExecMode, pgx.QueryResultFormats, pgx.QueryResultFormatsByOID:
		return false
	}
	_, ok := knownStatements(t.Tx.Conn())[sql]
	return ok
}

// learn records that sql ran on the transaction's connection.
func (t handlerTx) learn(sql string) {
	if t.sp != nil {
		knownStatements(t.Tx.Conn())[sql] = struct{}{}
	}
}

// knownStatementsKey keys, in a connection's custom data, the statements
// that ran on it; maxKnownStatements bounds them (the set starts again).
const (
	knownStatementsKey = "idemq.consumer.known_statements"
	maxKnownStatements = 1024
)

func knownStatements(conn *pgx.Conn) map[string]struct{} {
	data := conn.PgConn().CustomData()
	known, _ := data[knownStatementsKey].(map[string]struct{})
	if known == nil || len(known) >= maxKnownStatements {
		known = map[string]struct{}{}
		data[knownStatementsKey] = known
	}
	return known
}

// owes opens the owed savepoint on its own, for a statement that cannot
// carry it.
func (t handlerTx) owes(ctx context.Context) error {
	if t.sp == nil {
		return nil
	}
	return t.sp.flush(ctx)
}

func (t handlerTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if !t.carries(sql, args) {
		if err := t.owes(ctx); err != nil {
			return pgconn.CommandTag{}, err
		}
		tag, err := t.Tx.Exec(ctx, sql, args...)
		if err == nil {
			t.learn(sql)
		}
		return tag, err
	}
	b := &pgx.Batch{}
	t.sp.queueOwed(b)
	b.Queue(sql, args...)
	var tag pgconn.CommandTag
	err := t.sp.send(ctx, b, func(br pgx.BatchResults) (err error) {
		tag, err = br.Exec()
		return err
	})
	return tag, err
}

func (t handlerTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if !t.carries(sql, args) {
		if err := t.owes(ctx); err != nil {
			return nil, err
		}
		rows, err := t.Tx.Query(ctx, sql, args...)
		if err == nil {
			t.learn(sql)
		}
		return rows, err
	}
	b := &pgx.Batch{}
	t.sp.queueOwed(b)
	b.Queue(sql, args...)
	br := t.Tx.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		_ = br.Close()
		return nil, err
	}
	t.sp.opened()
	rows, err := br.Query()
	if err != nil {
		_ = br.Close()
		return nil, err
	}
	return &batchRows{Rows: rows, br: br}, nil
}

func (t handlerTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if !t.carries(sql, args) {
		if err := t.owes(ctx); err != nil {
			return errRow{err}
		}
		return learningRow{t.Tx.QueryRow(ctx, sql, args...), t, sql}
	}
	rows, err := t.Query(ctx, sql, args...)
	if err != nil {
		return errRow{err}
	}
	return pgxRow{rows}
}

func (t handlerTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	// If the savepoint failed, so does the batch: the transaction is broken.
	_ = t.owes(ctx)
	return t.Tx.SendBatch(ctx, b)
}

func (t handlerTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if err := t.owes(ctx); err != nil {
		return 0, err
	}
	return t.Tx.CopyFrom(ctx, table, columns, src)
}

func (t handlerTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := t.owes(ctx); err != nil {
		return nil, err
	}
	return t.Tx.Prepare(ctx, name, sql)
}

func (t handlerTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := t.owes(ctx); err != nil {
		return nil, err
	}
	return t.Tx.Begin(ctx)
}

func (t handlerTx) LargeObjects() pgx.LargeObjects {
	_ = t.owes(context.Background()) // a failure breaks the transaction, which its next statement reports
	return t.Tx.LargeObjects()
}

func (t handlerTx) Conn() *pgx.Conn {
	_ = t.owes(context.Background()) // a failure breaks the transaction, which its next statement reports
	return t.Tx.Conn()
}

// batchRows are the rows of a query that carried a savepoint: closing them
// (or reading them to the end) also ends the batch, which frees the
// connection.
type batchRows struct {
	pgx.Rows
	br     pgx.BatchResults
	closed bool
	err    error
}

func (r *batchRows) Next() bool {
	if r.Rows.Next() {
		return true
	}
	r.Close()
	return false
}

func (r *batchRows) Close() {
	if r.closed {
		return
	}
	r.closed = true
	r.Rows.Close()
	r.err = r.br.Close()
}

func (r *batchRows) Err() error {
	if err := r.Rows.Err(); err != nil {
		return err
	}
	return r.err
}

// pgxRow is QueryRow's row over Query's rows, as pgx builds its own.
type pgxRow struct{ rows pgx.Rows }

func (r pgxRow) Scan(dest ...any) error {
	defer r.rows.Close()
	if !r.rows.Next() {
		if err := r.rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	if err := r.rows.Scan(dest...); err != nil {
		return err
	}
	r.rows.Close()
	return r.rows.Err()
}

// learningRow records its statement as known once it scanned (or found no
// row): it was prepared.
type learningRow struct {
	pgx.Row
	t   handlerTx
	sql string
}

func (r learningRow) Scan(dest ...any) error {
	err := r.Row.Scan(dest...)
	if err == nil || errors.Is(err, pgx.ErrNoRows) {
		r.t.learn(r.sql)
	}
	return err
}

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }
