package cli

import (
	"encoding/hex"
	"fmt"
	"os"
	"strings"

	"github.com/spf13/pflag"

	"github.com/idemq/idemq/internal/wire"
)

// headerKeysEnv is the fallback of --header-keys-file.
const headerKeysEnv = "IDEMQ_HEADER_KEYS_FILE"

// headerKeysFlag registers --header-keys-file.
func headerKeysFlag(f *pflag.FlagSet, path *string) {
	f.StringVar(path, "header-keys-file", "", "file of the keys that sign idemq's headers on retry and dead-letter copies: one hex key of at least 32 digits per line, the signing key first; every worker of a queue needs the same file (env "+headerKeysEnv+"; default: the key 'idemq migrate' created in the schema)")
}

// headerKeys reads the keys of the --header-keys-file path (else of the
// file $IDEMQ_HEADER_KEYS_FILE names): one hex key per line, blank lines and
// lines starting with # ignored. Nil without a file: the consumer then
// uses the keys of its schema. Errors never quote a key.
func (a *app) headerKeys(path string) ([][]byte, error) {
	flag := "--header-keys-file"
	if path == "" {
		path, flag = a.getenv(headerKeysEnv), headerKeysEnv
	}
	if path == "" {
		return nil, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read header keys: %w", err)
	}
	var keys [][]byte
	for i, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, err := hex.DecodeString(line)
		if err != nil {
			return nil, usagef("%s %s, line %d: not a hex key", flag, path, i+1)
		}
		if len(k) < wire.MinKeyLen {
			return nil, usagef("%s %s, line %d: a key of %d bytes, want at least %d (openssl rand -hex 32)", flag, path, i+1, len(k), wire.MinKeyLen)
		}
		keys = append(keys, k)
	}
	if len(keys) == 0 {
		return nil, usagef("%s %s holds no key", flag, path)
	}
	return keys, nil
}
