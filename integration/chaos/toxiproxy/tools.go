//go:build tools

// Package toxiproxy pins the version of toxiproxy-server that the chaos soak
// builds (see build.sh). It is a module of its own so that toxiproxy and its
// dependencies stay out of idemq's go.mod.
package toxiproxy

import _ "github.com/Shopify/toxiproxy/v2/cmd/server"
