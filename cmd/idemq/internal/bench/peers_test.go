package bench

import "testing"

func TestWithSearchPath(t *testing.T) {
	got, err := withSearchPath("postgres://postgres@127.0.0.1:5432/test?sslmode=disable", "s")
	if err != nil || got != "postgres://postgres@127.0.0.1:5432/test?search_path=s&sslmode=disable" {
		t.Errorf("URL: %q, %v", got, err)
	}
	got, err = withSearchPath("host=127.0.0.1 user=postgres", "s")
	if err != nil || got != "host=127.0.0.1 user=postgres search_path=s" {
		t.Errorf("DSN: %q, %v", got, err)
	}
}
