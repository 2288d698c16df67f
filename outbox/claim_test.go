package outbox_test

import (
	"context"
	"errors"
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/outbox"
)

// Only the consumer runtime sets the claim that message ids derive from:
// code that enqueues with what this package exports gets random ids, never
// the ids of an operation.
func TestNoPublicWayToSetAClaim(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx := outbox.WithStep(outbox.NewContext(context.Background(), e.ob), "capture")
	if c, _, ok := outbox.ScopeFrom(ctx); ok {
		t.Fatalf("scope %+v in a context made with the public API", c)
	}
	var ids []string
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		if err := outbox.Enqueue(ctx, tx, outbox.Message{RoutingKey: "q"}); err != nil {
			return err
		}
		if err := e.ob.EnqueueBatch(ctx, tx, []outbox.Message{{RoutingKey: "q"}}); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, "SELECT message_id FROM "+e.schema+".outbox")
		if err != nil {
			return err
		}
		ids, err = pgx.CollectRows(rows, pgx.RowTo[string])
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	uuid := regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)
	for _, id := range ids {
		if !uuid.MatchString(id) {
			t.Errorf("message id %q without the runtime: want a random UUID", id)
		}
	}

	// And nothing exported hands out a context but WithStep (which only
	// renames the step of a claim already there), NewContext (which sets
	// the outbox, not a claim), WithDeferred (which collects rows, whose
	// ids are derived as always) and WakeAfterCommit (which collects the
	// outboxes to wake); only MessageID takes a Claim, to compute.
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || !fn.Name.IsExported() {
				continue
			}
			if fn.Type.Results != nil {
				for _, r := range fn.Type.Results.List {
					if types(r.Type) == "context.Context" && fn.Name.Name != "WithStep" && fn.Name.Name != "NewContext" && fn.Name.Name != "WithDeferred" && fn.Name.Name != "WakeAfterCommit" {
						t.Errorf("%s returns a context.Context", fn.Name.Name)
					}
				}
			}
			for _, p := range fn.Type.Params.List {
				if strings.Contains(types(p.Type), "Claim") && fn.Name.Name != "MessageID" {
					t.Errorf("%s takes a Claim", fn.Name.Name)
				}
			}
		}
	}
}

// types renders a parameter or result type as written.
func types(e ast.Expr) string {
	switch x := e.(type) {
	case *ast.Ident:
		return x.Name
	case *ast.SelectorExpr:
		return types(x.X) + "." + x.Sel.Name
	case *ast.StarExpr:
		return "*" + types(x.X)
	case *ast.ArrayType:
		return "[]" + types(x.Elt)
	case *ast.Ellipsis:
		return "..." + types(x.Elt)
	}
	return ""
}

// The package-level Enqueue needs the outbox in the context: it does not
// guess a schema.
func TestEnqueueWithoutAnOutboxInTheContext(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		return errors.Join(
			outbox.Enqueue(ctx, tx, outbox.Message{RoutingKey: "q"}),
			outbox.EnqueueBatch(ctx, tx, []outbox.Message{{RoutingKey: "q"}}),
		)
	})
	if !errors.Is(err, outbox.ErrNoOutbox) {
		t.Fatalf("enqueue without an outbox in the context: %v, want ErrNoOutbox", err)
	}
	if ob, ok := outbox.FromContext(outbox.NewContext(ctx, e.ob)); !ok || ob != e.ob {
		t.Fatalf("FromContext = %v, %v", ob, ok)
	}
}
