#!/usr/bin/env bash
# ensure-chromium.sh: make sure a Chromium that the browser test of the UI
# (integration/browser) can drive is installed, installing Debian's chromium
# package if needed.
#
# In order:
#   1. IDEMQ_CHROMIUM is set                -> it must be an executable
#   2. chromium (or chromium-browser, google-chrome) on PATH -> done
#   3. running as root with apt-get         -> apt-get install -y chromium
#   4. otherwise                            -> exit 1 with the command to run
# then check that the browser starts (--version).
#
# Idempotent: running it again when Chromium is there only checks.
# All messages go to stderr.
set -euo pipefail

log() { printf 'ensure-chromium: %s\n' "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}
have() { command -v "$1" >/dev/null 2>&1; }

find_browser() {
	local name
	for name in chromium chromium-browser google-chrome google-chrome-stable; do
		if have "$name"; then
			command -v "$name"
			return 0
		fi
	done
	return 1
}

if [[ -n ${IDEMQ_CHROMIUM:-} ]]; then
	have "$IDEMQ_CHROMIUM" || die "IDEMQ_CHROMIUM=$IDEMQ_CHROMIUM is not an executable"
	browser=$(command -v "$IDEMQ_CHROMIUM")
elif ! browser=$(find_browser); then
	if [[ $EUID -ne 0 ]] || ! have apt-get; then
		die "Chromium is not installed; the UI's browser test needs it. Install it with
    sudo apt-get install -y chromium
or set IDEMQ_CHROMIUM to a Chromium or Chrome binary."
	fi
	log "installing Debian's chromium (apt-get install -y chromium; a few minutes the first time)"
	install_log="${TMPDIR:-/tmp}/idemq-chromium-install.$EUID.log"
	if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >"$install_log" 2>&1; then
		tail -n 20 "$install_log" >&2 || true
		die "apt-get install chromium failed (full log: $install_log)"
	fi
	browser=$(find_browser) || die "chromium was installed but is not on PATH"
fi

if ! version=$(timeout 60 "$browser" --headless --no-sandbox --version 2>/dev/null); then
	die "$browser does not start (try: $browser --headless --no-sandbox --version)"
fi
log "using $browser ($version)"
