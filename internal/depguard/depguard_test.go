// Package depguard holds the test that keeps the library module small: the
// binary and the heavy tools are modules of their own, and this test fails
// when the library's module graph grows past the list kept beside it.
package depguard

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// root is the library module's directory, from this package's.
const root = "../.."

// goList runs the go command in the library module alone (no go.work) and
// returns its output lines.
func goList(t *testing.T, args ...string) []string {
	t.Helper()
	cmd := exec.Command("go", args...)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=readonly")
	out, err := cmd.Output()
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, stderr)
	}
	return strings.Fields(string(out))
}

func allowedModules(t *testing.T) []string {
	t.Helper()
	f, err := os.Open("modules.txt")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var mods []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line != "" && !strings.HasPrefix(line, "#") {
			mods = append(mods, line)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return mods
}

// TestModuleGraphIsTheKeptList fails when the library module requires a
// module that modules.txt does not list, or no longer requires one it lists.
func TestModuleGraphIsTheKeptList(t *testing.T) {
	graph := goList(t, "list", "-m", "-f", "{{if not .Main}}{{.Path}}{{end}}", "all")
	allowed := allowedModules(t)
	var added, gone []string
	for _, m := range graph {
		if !slices.Contains(allowed, m) {
			added = append(added, m)
		}
	}
	for _, m := range allowed {
		if !slices.Contains(graph, m) {
			gone = append(gone, m)
		}
	}
	if len(added) > 0 {
		t.Errorf("the library module's graph grew by %d modules (every library user would see them): %s\n"+
			"keep them out of the root go.mod (the binary and tools are modules of their own), "+
			"or add them to %s and say why in docs/development.md",
			len(added), strings.Join(added, " "), filepath.Join("internal/depguard", "modules.txt"))
	}
	if len(gone) > 0 {
		t.Errorf("modules.txt lists %d modules the library no longer requires: %s; remove them from the list",
			len(gone), strings.Join(gone, " "))
	}
}

// forbidden are modules only the binary may build with.
var forbidden = []string{
	"github.com/spf13/cobra", "github.com/schollz/progressbar", "github.com/prometheus/",
	"google.golang.org/grpc", "go.opentelemetry.io/otel/exporters/", "github.com/jackc/tern",
}

// TestLibraryBuildsWithoutTheBinarysDependencies lists every package the
// library's packages build with (tests excluded) and fails on any of the
// binary's own dependencies.
func TestLibraryBuildsWithoutTheBinarysDependencies(t *testing.T) {
	deps := goList(t, "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", "./...")
	for _, p := range deps {
		for _, f := range forbidden {
			if strings.HasPrefix(p, f) {
				t.Errorf("the library builds with %s", p)
			}
		}
	}
}
