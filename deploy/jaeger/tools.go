//go:build tools

// Package tools pins the Jaeger v2 binary that the integration tests run.
// It is built by build.sh; nothing imports this package.
package tools

import (
	_ "github.com/jaegertracing/jaeger/cmd/jaeger"
)
