#!/usr/bin/env bash
# Stops the Jaeger started by run.sh (the pid in
# ${IDEMQ_CACHE_DIR:-$HOME/.cache/idemq}/jaeger.pid). A no-op if it is not running.
set -euo pipefail

cache_dir="${IDEMQ_CACHE_DIR:-$HOME/.cache/idemq}"
pid_file="$cache_dir/jaeger.pid"

if [[ ! -s "$pid_file" ]]; then
	echo "no $pid_file: jaeger is not running from run.sh" >&2
	exit 0
fi
pid="$(cat "$pid_file")"

# Only signal the pid if it is still a jaeger process (pids get reused).
if ! kill -0 "$pid" 2>/dev/null || ! grep -qa jaeger "/proc/$pid/cmdline" 2>/dev/null; then
	echo "jaeger pid $pid is not running" >&2
	rm -f "$pid_file"
	exit 0
fi

kill -TERM "$pid"
for ((i = 0; i < 40; i++)); do
	kill -0 "$pid" 2>/dev/null || break
	sleep 0.25
done
if kill -0 "$pid" 2>/dev/null; then
	echo "jaeger pid $pid still running after 10s, sending SIGKILL" >&2
	kill -KILL "$pid" 2>/dev/null || true
fi
rm -f "$pid_file"
echo "jaeger pid $pid stopped" >&2
