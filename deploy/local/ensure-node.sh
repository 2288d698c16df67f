#!/usr/bin/env bash
# ensure-node.sh: make sure Node.js 18 or later (Debian 12's) and npm are installed, for
# the tests that publish and read CloudEvents with the cloudevents and
# amqplib npm packages (integration/interop).
#
# In order:
#   1. node (and npm) on PATH, Node.js >= 18          -> done
#   2. running as root with apt-get, and the
#      distribution's nodejs is >= 18                 -> apt-get install -y nodejs npm
#   3. running as root                                -> the official Node.js
#      binaries (NODE_VERSION from NODE_DIST, https://nodejs.org/dist or a
#      mirror, checked against the release's SHASUMS256.txt) unpacked into
#      NODE_PREFIX (/usr/local)
#   4. otherwise                                      -> exit 1 with what to run
#
# Idempotent: running it again when Node.js is there only checks.
# All messages go to stderr.
set -euo pipefail

NODE_VERSION=${NODE_VERSION:-v20.20.2}
NODE_PREFIX=${NODE_PREFIX:-/usr/local}
NODE_DIST=${NODE_DIST:-https://nodejs.org/dist}
MIN_MAJOR=18 # the cloudevents package (9.0.0) needs >= 18, amqplib >= 18

log() { printf 'ensure-node: %s\n' "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}
have() { command -v "$1" >/dev/null 2>&1; }

# major prints the major version of the node on PATH (0 when none).
major() {
	local v
	v=$(node --version 2>/dev/null) || {
		echo 0
		return
	}
	v=${v#v}
	echo "${v%%.*}"
}

usable() { have node && have npm && [[ $(major) -ge $MIN_MAJOR ]]; }

if usable; then
	log "using $(command -v node) ($(node --version)), npm $(npm --version)"
	exit 0
fi

if [[ $EUID -ne 0 ]]; then
	die "Node.js >= $MIN_MAJOR with npm is not installed; the interop tests need it. Install it
    (Debian 13: sudo apt-get install -y nodejs npm; Debian 12: see https://nodejs.org/en/download)
or run this script as root to install the official binaries into $NODE_PREFIX."
fi

candidate=0
if have apt-get && have apt-cache; then
	apt-get update -qq >/dev/null 2>&1 || log "apt-get update failed; using the package lists there are"
	v=$(apt-cache policy nodejs 2>/dev/null | awk '/Candidate:/ { print $2 }')
	v=${v#*:}
	[[ $v =~ ^[0-9]+ ]] && candidate=${BASH_REMATCH[0]}
fi
install_log="${TMPDIR:-/tmp}/idemq-node-install.$EUID.log"
if [[ $candidate -ge $MIN_MAJOR ]]; then
	log "installing the distribution's nodejs $candidate and npm (apt-get install -y nodejs npm)"
	if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >"$install_log" 2>&1; then
		tail -n 20 "$install_log" >&2 || true
		die "apt-get install nodejs npm failed (full log: $install_log)"
	fi
else
	case $(uname -m) in
	x86_64) arch=x64 ;;
	aarch64 | arm64) arch=arm64 ;;
	*) die "no official Node.js binaries for $(uname -m); install Node.js >= $MIN_MAJOR by hand" ;;
	esac
	have curl || die "curl is needed to download Node.js"
	name="node-$NODE_VERSION-linux-$arch.tar.xz"
	base="$NODE_DIST/$NODE_VERSION"
	work=$(mktemp -d)
	trap 'rm -rf "$work"' EXIT
	log "downloading $base/$name (no nodejs >= $MIN_MAJOR among the distribution's packages)"
	curl -fsSL --retry 3 -o "$work/$name" "$base/$name" || die "download $base/$name failed"
	curl -fsSL --retry 3 -o "$work/SHASUMS256.txt" "$base/SHASUMS256.txt" || die "download $base/SHASUMS256.txt failed"
	(cd "$work" && grep " $name\$" SHASUMS256.txt | sha256sum -c --status -) || die "$name does not match $base/SHASUMS256.txt"
	mkdir -p "$NODE_PREFIX"
	tar -xJf "$work/$name" -C "$NODE_PREFIX" --strip-components=1 --no-same-owner \
		"node-$NODE_VERSION-linux-$arch/bin" "node-$NODE_VERSION-linux-$arch/lib" "node-$NODE_VERSION-linux-$arch/include" \
		|| die "unpack $name into $NODE_PREFIX failed"
	export PATH="$NODE_PREFIX/bin:$PATH"
fi
usable || die "Node.js was installed but node >= $MIN_MAJOR and npm are not on PATH (PATH=$PATH)"
log "using $(command -v node) ($(node --version)), npm $(npm --version)"
