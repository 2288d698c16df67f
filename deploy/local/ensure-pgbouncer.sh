#!/usr/bin/env bash
# ensure-pgbouncer.sh: make sure a PgBouncer in transaction pooling mode
# answers on 127.0.0.1:${IDEMQ_PGBOUNCER_PORT:-6432} in front of the local
# Postgres (127.0.0.1:5432), for the suites make test runs through it
# (docs/operations.md, "PgBouncer"). Prints the URL the tests use.
#
# In order:
#   1. one answers on the port          -> done
#   2. pgbouncer missing, running as root -> apt-get install pgbouncer
#   3. start it: its own config, auth file and log under
#      ${TMPDIR:-/tmp}/idemq-pgbouncer.$EUID, as the postgres user when root
#      (PgBouncer refuses to run as root)
#
# Its pools: transaction mode; users are looked up in Postgres (auth_user
# postgres, trust), so that roles the tests create log in through it.
# Idempotent. Messages go to stderr, the URL to stdout.
set -euo pipefail

readonly PORT=${IDEMQ_PGBOUNCER_PORT:-6432}
readonly DIR="${TMPDIR:-/tmp}/idemq-pgbouncer.$EUID"
readonly URL="postgres://postgres@127.0.0.1:$PORT/test?sslmode=disable&default_query_exec_mode=cache_describe"

log() { printf 'ensure-pgbouncer: %s\n' "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}
answers() { psql "postgres://postgres@127.0.0.1:$PORT/test?sslmode=disable&connect_timeout=3" -Atqc 'SELECT 1' >/dev/null 2>&1; }

if answers; then
	echo "$URL"
	exit 0
fi

if ! command -v pgbouncer >/dev/null 2>&1 && [[ ! -x /usr/sbin/pgbouncer ]]; then
	if [[ $EUID -ne 0 ]]; then
		die "pgbouncer is not installed: run sudo apt-get install -y pgbouncer"
	fi
	log "installing Debian's pgbouncer"
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q pgbouncer >&2 || {
		apt-get update -q >&2
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q pgbouncer >&2
	}
fi
bin=$(command -v pgbouncer || echo /usr/sbin/pgbouncer)

mkdir -p "$DIR"
cat >"$DIR/pgbouncer.ini" <<INI
[databases]
* = host=127.0.0.1 port=5432

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $PORT
unix_socket_dir =
pool_mode = transaction
auth_type = trust
auth_file = $DIR/userlist.txt
auth_user = postgres
max_client_conn = 2000
default_pool_size = 70
max_db_connections = 80
ignore_startup_parameters = extra_float_digits
server_login_retry = 1
logfile = $DIR/pgbouncer.log
pidfile = $DIR/pgbouncer.pid
admin_users = postgres
INI
echo '"postgres" ""' >"$DIR/userlist.txt"
run_as=()
if [[ $EUID -eq 0 ]]; then
	chown -R postgres "$DIR"
	run_as=(-u postgres)
fi
log "starting $bin on 127.0.0.1:$PORT (transaction pooling; config $DIR/pgbouncer.ini)"
"$bin" -d "${run_as[@]}" "$DIR/pgbouncer.ini" >&2 || die "pgbouncer did not start: see $DIR/pgbouncer.log"
for _ in $(seq 1 50); do
	if answers; then
		echo "$URL"
		exit 0
	fi
	sleep 0.2
done
die "pgbouncer does not answer on 127.0.0.1:$PORT: see $DIR/pgbouncer.log"
