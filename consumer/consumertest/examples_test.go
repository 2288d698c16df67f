package consumertest_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestExamplesImportOnlyPublicPackages: every file of the repository with
// an Example function imports only packages a user can import too, so
// that what the package documentation shows can be copied (examples run
// handlers and get their schemas through the public kit for that).
func TestExamplesImportOnlyPublicPackages(t *testing.T) {
	t.Parallel()
	root := repoRoot(t)
	fset := token.NewFileSet()
	files := 0
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if path != root && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		if !hasExample(f) {
			return nil
		}
		files++
		for _, imp := range f.Imports {
			p, _ := strconv.Unquote(imp.Path.Value)
			if strings.HasPrefix(p, "github.com/idemq/idemq") && (strings.Contains(p, "/internal/") || strings.HasSuffix(p, "/internal")) {
				rel, _ := filepath.Rel(root, path)
				t.Errorf("%s has examples and imports %s, which users cannot import", rel, p)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if files == 0 {
		t.Fatalf("no file with examples under %s", root)
	}
}

// hasExample reports whether f declares an Example function.
func hasExample(f *ast.File) bool {
	for _, decl := range f.Decls {
		if fn, ok := decl.(*ast.FuncDecl); ok && fn.Recv == nil && strings.HasPrefix(fn.Name.Name, "Example") {
			return true
		}
	}
	return false
}

// repoRoot is the directory of the repository: the outermost one above
// the test with a go.mod (the library's module; the binary and the
// integration tests may be modules of their own below it).
func repoRoot(t *testing.T) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	root := ""
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
			root = d
		}
		if filepath.Dir(d) == d {
			break
		}
	}
	if root == "" {
		t.Fatalf("no go.mod above %s", dir)
	}
	return root
}
