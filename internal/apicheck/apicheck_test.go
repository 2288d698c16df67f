package apicheck_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/idemq/idemq/internal/apicheck"
)

// apiFile is the recorded API, relative to the repository root.
const apiFile = "docs/api.txt"

// TestAPI fails when the exported API of a public package differs from
// docs/api.txt. After a deliberate change, record it with
//
//	IDEMQ_API_UPDATE=1 go test ./internal/apicheck
//
// and name the change in CHANGELOG.md (Unreleased), with the replacement of
// every removed name.
func TestAPI(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	dirs, err := apicheck.Packages(root)
	if err != nil {
		t.Fatal(err)
	}
	lines, err := apicheck.Lines(root, "github.com/idemq/idemq", dirs)
	if err != nil {
		t.Fatal(err)
	}
	got := strings.Join(lines, "\n") + "\n"
	path := filepath.Join(root, apiFile)
	if os.Getenv("IDEMQ_API_UPDATE") == "1" {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("read the recorded API: %v (record it with IDEMQ_API_UPDATE=1 go test ./internal/apicheck)", err)
	}
	want := map[string]bool{}
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		want[l] = true
	}
	have := map[string]bool{}
	for _, l := range lines {
		have[l] = true
		if !want[l] {
			t.Errorf("+%s", l)
		}
	}
	for l := range want {
		if !have[l] {
			t.Errorf("-%s", l)
		}
	}
	if t.Failed() {
		t.Logf("the exported API differs from %s (+ new, - gone): if the change is meant, record it with IDEMQ_API_UPDATE=1 go test ./internal/apicheck and name it in CHANGELOG.md", apiFile)
	}
}

// TestPackages: the public packages are the ones users import, and only them.
func TestPackages(t *testing.T) {
	dirs, err := apicheck.Packages("../..")
	if err != nil {
		t.Fatal(err)
	}
	got := strings.Join(dirs, " ")
	for _, want := range []string{"consumer", "consumer/consumertest", "consumer/idemqotel", "dedup", "dedup/idemhttp", "dedup/schema", "outbox", "outbox/publish"} {
		if !strings.Contains(" "+got+" ", " "+want+" ") {
			t.Errorf("public packages %q lack %s", got, want)
		}
	}
	for _, never := range []string{"internal", "cmd/", "integration", "bench"} {
		if strings.Contains(got, never) {
			t.Errorf("public packages %q include %s", got, never)
		}
	}
}
