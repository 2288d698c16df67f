#!/usr/bin/env bash
# Starts the local Jaeger v2 (building it first via build.sh if needed) in the
# background with config.yaml, and waits until its query API answers.
# A no-op if http://127.0.0.1:16686/api/services already answers.
#   pid: ${IDEMQ_CACHE_DIR:-$HOME/.cache/idemq}/jaeger.pid
#   log: ${IDEMQ_CACHE_DIR:-$HOME/.cache/idemq}/jaeger.log
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_dir="${IDEMQ_CACHE_DIR:-$HOME/.cache/idemq}"
pid_file="$cache_dir/jaeger.pid"
log_file="$cache_dir/jaeger.log"
probe="http://127.0.0.1:16686/api/services"
wait_seconds="${JAEGER_WAIT_SECONDS:-60}"

answers() { curl -fsS -o /dev/null --max-time 2 "$probe" 2>/dev/null; }

if answers; then
	echo "jaeger already answers at $probe" >&2
	exit 0
fi

bin="$("$here/build.sh" | tail -n1)"
mkdir -p "$cache_dir"

# A pid file left by a process that is still alive but not answering (still
# starting, or wedged) is not overwritten blindly.
if [[ -s "$pid_file" ]]; then
	old="$(cat "$pid_file")"
	if kill -0 "$old" 2>/dev/null && grep -qa jaeger "/proc/$old/cmdline" 2>/dev/null; then
		echo "jaeger pid $old is running but $probe does not answer yet; waiting" >&2
		pid="$old"
	else
		rm -f "$pid_file"
	fi
fi

if [[ -z "${pid:-}" ]]; then
	echo "starting $bin --config $here/config.yaml (log: $log_file)" >&2
	# setsid: its own session, so it outlives this script and the caller's
	# terminal; stdin from /dev/null so it never holds a pipe open.
	setsid "$bin" --config "$here/config.yaml" </dev/null >"$log_file" 2>&1 &
	pid=$!
	echo "$pid" >"$pid_file"
fi

for ((i = 0; i < wait_seconds * 4; i++)); do
	if answers; then
		echo "jaeger (pid $pid) answers at $probe" >&2
		exit 0
	fi
	if ! kill -0 "$pid" 2>/dev/null; then
		echo "jaeger (pid $pid) exited; last log lines:" >&2
		tail -n 30 "$log_file" >&2 || true
		rm -f "$pid_file"
		exit 1
	fi
	sleep 0.25
done

echo "jaeger (pid $pid) did not answer at $probe within ${wait_seconds}s; last log lines:" >&2
tail -n 30 "$log_file" >&2 || true
exit 1
