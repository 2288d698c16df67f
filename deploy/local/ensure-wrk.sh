#!/usr/bin/env bash
# ensure-wrk.sh: make sure wrk, the HTTP load generator of idemq bench's
# HTTP front door (and of its test), is installed, installing Debian's wrk
# package if needed.
#
# In order:
#   1. wrk on PATH                     -> done
#   2. running as root with apt-get    -> apt-get install -y wrk
#   3. otherwise                       -> exit 1 with the command to run
#
# Idempotent: running it again when wrk is there only checks.
# All messages go to stderr.
set -euo pipefail

log() { printf 'ensure-wrk: %s\n' "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}
have() { command -v "$1" >/dev/null 2>&1; }

if ! have wrk; then
	if [[ $EUID -ne 0 ]] || ! have apt-get; then
		die "wrk is not installed; idemq bench's HTTP rows and their test need it. Install it with
    sudo apt-get install -y wrk"
	fi
	log "installing Debian's wrk (apt-get install -y wrk)"
	install_log="${TMPDIR:-/tmp}/idemq-wrk-install.$EUID.log"
	if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk; } >"$install_log" 2>&1; then
		tail -n 20 "$install_log" >&2 || true
		die "apt-get install wrk failed (full log: $install_log)"
	fi
	have wrk || die "wrk was installed but is not on PATH"
fi
log "using $(command -v wrk)"
