package cli

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestHeaderKeysFile(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	const k1, k2 = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff", "ffeeddccbbaa99887766554433221100"
	env := map[string]string{}
	a := &app{stdout: io.Discard, stderr: io.Discard, getenv: func(k string) string { return env[k] }}

	keys, err := a.headerKeys(write("ok", "# signing key first\n"+k1+"\n\n  "+k2+"  \n"))
	if err != nil || len(keys) != 2 || len(keys[0]) != 32 || len(keys[1]) != 16 || keys[1][0] != 0xff {
		t.Fatalf("keys %d, %v", len(keys), err)
	}
	if keys, err := a.headerKeys(""); keys != nil || err != nil {
		t.Fatalf("no file: %v, %v; want nil (the schema's keys)", keys, err)
	}
	env[headerKeysEnv] = write("env", k2+"\n")
	if keys, err := a.headerKeys(""); err != nil || len(keys) != 1 {
		t.Fatalf("from %s: %d keys, %v", headerKeysEnv, len(keys), err)
	}

	secret := "not-hex-and-secret-0123456789abcdef"
	for name, text := range map[string]string{
		"not hex":   k1 + "\n" + secret + "\n",
		"too short": "00112233445566778899\n",
		"empty":     "# nothing\n\n",
	} {
		_, err := a.headerKeys(write(strings.ReplaceAll(name, " ", "-"), text))
		var ue *usageError
		if !errors.As(err, &ue) || strings.Contains(err.Error(), secret) || strings.Contains(err.Error(), "0011") {
			t.Errorf("%s: %v, want a usage error that quotes no key", name, err)
		}
	}
	if _, err := a.headerKeys(filepath.Join(dir, "absent")); err == nil {
		t.Error("a missing file: want an error")
	}
}
