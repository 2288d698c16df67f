#!/usr/bin/env bash
# Builds the Jaeger v2 binary pinned in this directory's go.mod, once, into
#   ${IDEMQ_CACHE_DIR:-$HOME/.cache/idemq}/jaeger-<module version>/jaeger
# and prints that path as the last line on stdout. If the binary is already
# there it only prints the path. A cold build takes about 10 minutes on 2 cores
# and fills roughly 3 GB of Go module and build caches.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"

# This directory is a module of its own: never let a go.work elsewhere pull it in.
export GOWORK=off
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"

version="$(go list -m -f '{{.Version}}' github.com/jaegertracing/jaeger)"
cache_dir="${IDEMQ_CACHE_DIR:-$HOME/.cache/idemq}"
out_dir="$cache_dir/jaeger-$version"
bin="$out_dir/jaeger"

if [[ -x "$bin" ]]; then
	echo "$bin"
	exit 0
fi
# --cached: only say whether it is built (exit 1 when not), never build.
if [[ "${1:-}" == "--cached" ]]; then
	exit 1
fi

mkdir -p "$out_dir"

# One build at a time: a second caller waits for the first, then finds the binary.
exec 9>"$out_dir/.build.lock"
flock 9
if [[ -x "$bin" ]]; then
	echo "$bin"
	exit 0
fi

# Jaeger's releases carry a v1 and a v2 version (v1.76.0 / v2.13.0); the binary
# reports the v2 one. Take it from the module's CHANGELOG, else the module version.
mod_dir="$(go list -m -f '{{.Dir}}' github.com/jaegertracing/jaeger 2>/dev/null || true)"
if [[ -z "$mod_dir" || ! -d "$mod_dir" ]]; then
	go mod download github.com/jaegertracing/jaeger
	mod_dir="$(go list -m -f '{{.Dir}}' github.com/jaegertracing/jaeger)"
fi
v2_version="$(sed -n "s|^${version//./\\.} / \(v2\.[0-9][0-9.]*\).*|\1|p" "$mod_dir/CHANGELOG.md" 2>/dev/null | head -n1 || true)"
v2_version="${v2_version:-$version}"

pkg=github.com/jaegertracing/jaeger/internal/version
ldflags="-s -w -X $pkg.latestVersion=$v2_version -X $pkg.commitSHA=module-$version"

echo "building jaeger $version ($v2_version) into $bin" >&2
start=$(date +%s)
tmp="$out_dir/.jaeger.tmp.$$"
trap 'rm -f "$tmp"' EXIT
# go.sum is committed, so the build runs -mod=readonly unless GOFLAGS already
# names a -mod (GOFLAGS=-mod=mod lets Go fill in missing go.sum entries).
goflags="${GOFLAGS:-}"
[[ "$goflags" == *-mod=* ]] || goflags="$goflags -mod=readonly"
CGO_ENABLED=0 GOFLAGS="$goflags" \
	nice -n 10 go build -trimpath -tags tools -ldflags "$ldflags" \
	-o "$tmp" github.com/jaegertracing/jaeger/cmd/jaeger
mv -f "$tmp" "$bin"
trap - EXIT
echo "built in $(($(date +%s) - start)) s" >&2

echo "$bin"
