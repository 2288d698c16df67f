#!/usr/bin/env bash
# Builds the toxiproxy-server pinned in this directory's go.mod, once, into
#   ${IDEMQ_CACHE_DIR:-$HOME/.cache/idemq}/toxiproxy-<module version>/toxiproxy-server
# and prints that path as the last line on stdout. If the binary is already
# there it only prints the path. The chaos soak (integration/chaos) calls it.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"

# This directory is a module of its own: never let a go.work elsewhere pull it in.
export GOWORK=off
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"

version="$(go list -m -f '{{.Version}}' github.com/Shopify/toxiproxy/v2)"
cache_dir="${IDEMQ_CACHE_DIR:-$HOME/.cache/idemq}"
out_dir="$cache_dir/toxiproxy-$version"
bin="$out_dir/toxiproxy-server"

if [[ -x "$bin" ]]; then
	echo "$bin"
	exit 0
fi
mkdir -p "$out_dir"

# One build at a time: a second caller waits for the first, then finds the binary.
exec 9>"$out_dir/.build.lock"
flock 9
if [[ -x "$bin" ]]; then
	echo "$bin"
	exit 0
fi

echo "building toxiproxy-server $version into $bin" >&2
tmp="$out_dir/.toxiproxy-server.tmp.$$"
trap 'rm -f "$tmp"' EXIT
# go.sum is committed, so the build runs -mod=readonly unless GOFLAGS names a -mod.
goflags="${GOFLAGS:-}"
[[ "$goflags" == *-mod=* ]] || goflags="$goflags -mod=readonly"
CGO_ENABLED=0 GOFLAGS="$goflags" go build -trimpath -tags tools -ldflags "-s -w" \
	-o "$tmp" github.com/Shopify/toxiproxy/v2/cmd/server
mv -f "$tmp" "$bin"
trap - EXIT
echo "$bin"
