// Package apicheck records the exported API of idemq's public packages, one
// line per exported name, in the manner of the Go project's api/*.txt files:
//
//	pkg github.com/idemq/idemq/dedup, func NewStore(*pgxpool.Pool, *Config) (*Store, error)
//	pkg github.com/idemq/idemq/dedup, method (*Store) Pool() *pgxpool.Pool
//	pkg github.com/idemq/idemq/dedup, type Config struct, Schema string
//
// The lines are read from the source (go/ast, no type checking): a type is
// written as the source writes it. TestAPI compares them with docs/api.txt,
// so a change to the exported API shows in review next to the file's diff,
// and CHANGELOG.md names it.
package apicheck

import (
	"bytes"
	"fmt"
	"go/ast"
	"go/parser"
	"go/printer"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Packages are the public packages, as paths under the repository root
// (github.com/idemq/idemq): every package outside internal/, cmd/,
// integration/, bench/ and deploy/.
func Packages(root string) ([]string, error) {
	var dirs []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			base := d.Name()
			if rel != "." && (strings.HasPrefix(base, ".") || base == "internal" || base == "testdata" ||
				slices.Contains([]string{"cmd", "integration", "bench", "deploy", "docs"}, rel)) {
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(path, ".go") && !strings.HasSuffix(path, "_test.go") {
			dir := filepath.ToSlash(filepath.Dir(rel))
			if !slices.Contains(dirs, dir) {
				dirs = append(dirs, dir)
			}
		}
		return nil
	})
	slices.Sort(dirs)
	return dirs, err
}

// Lines returns the API lines of every package in dirs (paths under root),
// sorted.
func Lines(root, module string, dirs []string) ([]string, error) {
	var out []string
	for _, dir := range dirs {
		path := module
		if dir != "." {
			path += "/" + dir
		}
		lines, err := packageLines(filepath.Join(root, dir), path)
		if err != nil {
			return nil, fmt.Errorf("api of %s: %w", path, err)
		}
		out = append(out, lines...)
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

func packageLines(dir, path string) ([]string, error) {
	fset := token.NewFileSet()
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var lines []string
	pkg := "pkg " + path + ", "
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() || !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, filepath.Join(dir, name), nil, parser.SkipObjectResolution)
		if err != nil {
			return nil, err
		}
		if f.Name.Name == "main" {
			continue
		}
		for _, decl := range f.Decls {
			for _, l := range declLines(fset, decl) {
				lines = append(lines, pkg+l)
			}
		}
	}
	return lines, nil
}

func declLines(fset *token.FileSet, decl ast.Decl) []string {
	var out []string
	switch d := decl.(type) {
	case *ast.FuncDecl:
		if !d.Name.IsExported() {
			return nil
		}
		sig := strings.TrimPrefix(expr(fset, d.Type), "func")
		if d.Recv == nil {
			return []string{"func " + d.Name.Name + typeParams(fset, d.Type) + sig}
		}
		recv := expr(fset, d.Recv.List[0].Type)
		if !ast.IsExported(strings.TrimLeft(strings.SplitN(recv, "[", 2)[0], "*")) {
			return nil
		}
		return []string{"method (" + recv + ") " + d.Name.Name + sig}
	case *ast.GenDecl:
		for _, spec := range d.Specs {
			switch s := spec.(type) {
			case *ast.TypeSpec:
				if !s.Name.IsExported() {
					continue
				}
				out = append(out, typeLines(fset, s)...)
			case *ast.ValueSpec:
				kind := "var"
				if d.Tok == token.CONST {
					kind = "const"
				}
				for i, n := range s.Names {
					if !n.IsExported() {
						continue
					}
					l := kind + " " + n.Name
					switch {
					case s.Type != nil:
						l += " " + expr(fset, s.Type)
					case i < len(s.Values):
						l += " = " + expr(fset, s.Values[i])
					}
					out = append(out, l)
				}
			}
		}
	}
	return out
}

func typeLines(fset *token.FileSet, s *ast.TypeSpec) []string {
	head := "type " + s.Name.Name
	if s.TypeParams != nil {
		head += expr(fset, s.TypeParams)
	}
	if s.Assign.IsValid() {
		return []string{head + " = " + expr(fset, s.Type)}
	}
	switch t := s.Type.(type) {
	case *ast.StructType:
		out := []string{head + " struct"}
		for _, f := range t.Fields.List {
			typ := expr(fset, f.Type)
			if len(f.Names) == 0 {
				if ast.IsExported(strings.TrimLeft(strings.TrimPrefix(typ[strings.LastIndex(typ, ".")+1:], "*"), "*")) {
					out = append(out, head+" struct, embedded "+typ)
				}
				continue
			}
			for _, n := range f.Names {
				if n.IsExported() {
					out = append(out, head+" struct, "+n.Name+" "+typ)
				}
			}
		}
		return out
	case *ast.InterfaceType:
		out := []string{head + " interface"}
		for _, m := range t.Methods.List {
			if len(m.Names) == 0 {
				out = append(out, head+" interface, embedded "+expr(fset, m.Type))
				continue
			}
			for _, n := range m.Names {
				if n.IsExported() {
					out = append(out, head+" interface, "+n.Name+strings.TrimPrefix(expr(fset, m.Type), "func"))
				}
			}
		}
		return out
	default:
		return []string{head + " " + expr(fset, s.Type)}
	}
}

func typeParams(fset *token.FileSet, t *ast.FuncType) string {
	if t.TypeParams == nil {
		return ""
	}
	return "[" + strings.Trim(expr(fset, t.TypeParams), "()") + "]"
}

// expr prints n on one line, without parameter names (a rename is not an
// API change).
func expr(fset *token.FileSet, n ast.Node) string {
	switch t := n.(type) {
	case *ast.FuncType:
		return "func(" + fieldTypes(fset, t.Params) + ")" + results(fset, t.Results)
	case *ast.FieldList:
		var parts []string
		for _, f := range t.List {
			var names []string
			for _, n := range f.Names {
				names = append(names, n.Name)
			}
			parts = append(parts, strings.Join(names, ", ")+" "+expr(fset, f.Type))
		}
		return "[" + strings.Join(parts, ", ") + "]"
	}
	var b bytes.Buffer
	_ = printer.Fprint(&b, fset, n)
	return strings.Join(strings.Fields(b.String()), " ")
}

func fieldTypes(fset *token.FileSet, fl *ast.FieldList) string {
	if fl == nil {
		return ""
	}
	var parts []string
	for _, f := range fl.List {
		n := max(len(f.Names), 1)
		for range n {
			parts = append(parts, expr(fset, f.Type))
		}
	}
	return strings.Join(parts, ", ")
}

func results(fset *token.FileSet, fl *ast.FieldList) string {
	if fl == nil || len(fl.List) == 0 {
		return ""
	}
	s := fieldTypes(fset, fl)
	if len(fl.List) == 1 && len(fl.List[0].Names) <= 1 {
		return " " + s
	}
	return " (" + s + ")"
}
