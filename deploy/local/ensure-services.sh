#!/usr/bin/env bash
# ensure-services.sh: make sure PostgreSQL (127.0.0.1:5432) and RabbitMQ
# (127.0.0.1:5672) answer and are usable, starting them if needed.
#
# In order:
#   1. both already usable                  -> done
#   2. a Docker engine answers              -> docker compose up -d the missing ones
#   3. Debian packages installed, stopped   -> start them (no systemd needed)
#   4. not installed and running as root    -> apt-get install, configure, start
#   5. not installed and not root           -> exit with the command to run
# then wait (bounded) until both answer a real client handshake.
#
# Idempotent: running it again when everything is up only checks.
# All messages go to stderr. See deploy/local/README.md.
#
# Environment:
#   IDEMQ_SERVICES_TIMEOUT   seconds to wait for readiness (default 120)

# The TCP probes run in a child bash (so that timeout can end them) and take
# host and port as $0 and $1: their single quotes are meant.
# shellcheck disable=SC2016
set -euo pipefail

readonly PG_HOST=127.0.0.1 PG_PORT=5432 PG_USER=postgres PG_TEST_DB=test
readonly AMQP_HOST=127.0.0.1 AMQP_PORT=5672
readonly TIMEOUT=${IDEMQ_SERVICES_TIMEOUT:-120}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
readonly ROOT
readonly COMPOSE_FILE="$ROOT/deploy/docker-compose.yml"
readonly RABBIT_START_LOG="${TMPDIR:-/tmp}/idemq-rabbitmq-start.$EUID.log"

# How the services were brought up ("", docker, local): used for hints.
MODE=""
# Last error seen by a readiness check, shown if we give up.
PG_ERR="" AMQP_ERR=""
# Commands that only root can run for us, printed at the end.
NEED_SUDO=()

log() { printf 'ensure-services: %s\n' "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}
have() { command -v "$1" >/dev/null 2>&1; }
is_root() { [[ $EUID -eq 0 ]]; }

# ---------------------------------------------------------------- checks ---

# port_open HOST PORT: something accepts TCP connections there.
port_open() {
	timeout 3 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$1" "$2" 2>/dev/null
}

# pg_usable: Postgres runs a query as user postgres over TCP (psql), or at
# least answers the protocol (pg_isready / SSLRequest) when no client exists.
pg_usable() {
	if have psql; then
		local out
		if out=$(PGCONNECT_TIMEOUT=3 psql -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" -d postgres \
			-w -X -A -t -q -c 'select 1' 2>&1) && [[ $out == 1 ]]; then
			return 0
		fi
		PG_ERR=${out:-no answer}
		return 1
	fi
	if have pg_isready; then
		if pg_isready -q -h "$PG_HOST" -p "$PG_PORT" -t 3; then
			return 0
		fi
		PG_ERR="pg_isready: not accepting connections"
		return 1
	fi
	# No client tools: send an SSLRequest; a Postgres server answers 'S' or 'N'.
	local reply
	reply=$(timeout 5 bash -c 'exec 3<>"/dev/tcp/$0/$1" || exit 1
		printf "\x00\x00\x00\x08\x04\xd2\x16\x2f" >&3; head -c 1 <&3' "$PG_HOST" "$PG_PORT" 2>/dev/null) || true
	if [[ $reply == S || $reply == N ]]; then
		return 0
	fi
	PG_ERR="no Postgres protocol answer on $PG_HOST:$PG_PORT"
	return 1
}

# pg_accepting: the server says it accepts connections (so a failing psql is
# a configuration problem, not a server still starting).
pg_accepting() {
	have pg_isready && pg_isready -q -h "$PG_HOST" -p "$PG_PORT" -t 3
}

# amqp_usable: send the AMQP 0-9-1 protocol header and expect the broker's
# connection.start method frame: type 1, channel 0, class 10, method 10.
amqp_usable() {
	local hex
	hex=$(timeout 5 bash -c 'exec 3<>"/dev/tcp/$0/$1" || exit 1
		printf "AMQP\x00\x00\x09\x01" >&3; head -c 11 <&3' "$AMQP_HOST" "$AMQP_PORT" 2>/dev/null |
		od -An -tx1 | tr -d ' \n') || true
	if [[ $hex == 010000????????000a000a ]]; then
		return 0
	fi
	if [[ -z $hex ]]; then
		AMQP_ERR="no answer on $AMQP_HOST:$AMQP_PORT"
	else
		AMQP_ERR="unexpected AMQP handshake reply (hex $hex)"
	fi
	return 1
}

# -------------------------------------------------------------- docker -----

docker_engine_up() {
	have docker && timeout 15 docker info >/dev/null 2>&1
}

compose() {
	if docker compose version >/dev/null 2>&1; then
		docker compose -f "$COMPOSE_FILE" "$@"
	elif have docker-compose; then
		docker-compose -f "$COMPOSE_FILE" "$@"
	else
		die "a Docker engine runs but neither 'docker compose' nor 'docker-compose' is installed"
	fi
}

start_with_docker() {
	MODE=docker
	log "Docker engine found: docker compose -f deploy/docker-compose.yml up -d $*"
	compose up -d "$@" >&2 9>&-
}

# ------------------------------------------------- Debian packages: Postgres ---

pg_installed() {
	have pg_lsclusters && have pg_ctlcluster && compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null
}

# pg_cluster: print "VERSION NAME STATUS" of the cluster meant to serve port
# 5432: the one configured on that port (preferring "main"), else the newest
# version's "main". Prints nothing when no cluster exists.
pg_cluster() {
	pg_lsclusters --no-header 2>/dev/null | awk -v port="$PG_PORT" '
		{ n++; ver[n] = $1; name[n] = $2; p[n] = $3; st[n] = $4 }
		END {
			best = 0
			for (i = 1; i <= n; i++) if (p[i] == port && (best == 0 || name[i] == "main")) best = i
			if (best == 0) for (i = 1; i <= n; i++) if (name[i] == "main" && (best == 0 || ver[i] + 0 > ver[best] + 0)) best = i
			if (best > 0) print ver[best], name[best], st[best]
		}'
}

pg_newest_version() {
	local d
	d=$(compgen -G '/usr/lib/postgresql/*/bin/postgres' | sort -V | tail -n 1)
	d=${d%/bin/postgres}
	printf '%s\n' "${d##*/}"
}

# pg_trust_loopback VERSION NAME: put a trust rule for user postgres on
# 127.0.0.1 first in pg_hba.conf (rules match top-down), once.
pg_trust_loopback() {
	local ver=$1 name=$2 hba marker='# idemq: local development, trust the postgres user over loopback'
	hba=/etc/postgresql/$ver/$name/pg_hba.conf
	if have pg_conftool; then
		hba=$(pg_conftool -s "$ver" "$name" show hba_file 2>/dev/null || echo "$hba")
	fi
	[[ -f $hba ]] || die "pg_hba.conf not found at $hba"
	if grep -qF "$marker" "$hba"; then
		return 0
	fi
	log "configuring $hba: trust user postgres on 127.0.0.1"
	local tmp
	tmp=$(mktemp)
	awk -v marker="$marker" '
		!done && $0 !~ /^[[:space:]]*(#|$)/ {
			print marker
			print "host    all             postgres        127.0.0.1/32            trust"
			print ""
			done = 1
		}
		{ print }
		END {
			if (!done) {
				print marker
				print "host    all             postgres        127.0.0.1/32            trust"
			}
		}' "$hba" >"$tmp"
	cat "$tmp" >"$hba" # keeps the file's owner and mode
	rm -f "$tmp"
}

start_local_postgres() {
	local ver name status
	read -r ver name status < <(pg_cluster) || true
	if [[ -z ${ver:-} ]]; then
		if ! is_root; then
			NEED_SUDO+=("pg_createcluster $(pg_newest_version) main --port $PG_PORT --start")
			return 0
		fi
		ver=$(pg_newest_version)
		name=main
		log "creating PostgreSQL cluster $ver/$name on port $PG_PORT"
		pg_createcluster "$ver" "$name" --port "$PG_PORT" >&2 9>&-
		status=down
	fi
	if [[ $status == online* ]]; then
		log "PostgreSQL cluster $ver/$name is online but $PG_HOST:$PG_PORT does not answer; check listen_addresses and port in /etc/postgresql/$ver/$name/postgresql.conf"
		return 0
	fi
	local cmd=(pg_ctlcluster --skip-systemctl-redirect "$ver" "$name" start)
	# pg_ctlcluster works for root and for the cluster's owner.
	if ! is_root && [[ $(id -un) != "$(stat -c %U "/var/lib/postgresql/$ver/$name" 2>/dev/null || echo postgres)" ]]; then
		NEED_SUDO+=("${cmd[*]}")
		return 0
	fi
	log "starting PostgreSQL: ${cmd[*]}"
	"${cmd[@]}" >&2 9>&- || die "'${cmd[*]}' failed; see /var/log/postgresql/postgresql-$ver-$name.log"
}

# ------------------------------------------------- Debian packages: RabbitMQ ---

rabbit_installed() {
	have rabbitmq-server && [[ -d /usr/lib/rabbitmq ]]
}

# rabbit_node_running: an Erlang node answers (it may still be booting).
rabbit_node_running() {
	have rabbitmq-diagnostics && timeout 20 rabbitmq-diagnostics -q ping >/dev/null 2>&1
}

start_local_rabbitmq() {
	if rabbit_node_running; then
		log "RabbitMQ node is running but $AMQP_HOST:$AMQP_PORT does not answer yet; waiting for it"
		return 0
	fi
	# The Debian wrapper only works for root (it switches to user rabbitmq)
	# or for the rabbitmq user itself.
	if ! is_root && [[ $(id -un) != rabbitmq ]]; then
		NEED_SUDO+=("rabbitmq-server -detached")
		return 0
	fi
	log "starting RabbitMQ: rabbitmq-server -detached (output in $RABBIT_START_LOG)"
	# New session and no inherited descriptors: the broker must not hold the
	# caller's terminal or pipes (make ... | tee would never finish), nor the
	# lock (fd 9).
	local launcher=()
	have setsid && launcher=(setsid -w)
	if ! "${launcher[@]}" rabbitmq-server -detached </dev/null >>"$RABBIT_START_LOG" 2>&1 9>&-; then
		tail -n 20 "$RABBIT_START_LOG" >&2 || true
		die "'rabbitmq-server -detached' failed; see $RABBIT_START_LOG and /var/log/rabbitmq/"
	fi
}

# ensure_rabbit_plugins: the consistent hash exchange (partitioned queues,
# docs/ordering.md) ships with RabbitMQ but is off by default. Enabling it is
# online and idempotent; a broker this script cannot reach as root or as a
# compose service is left alone, with a note.
readonly RABBIT_PLUGINS=(rabbitmq_consistent_hash_exchange)
ensure_rabbit_plugins() {
	if have rabbitmq-plugins && { is_root || [[ $(id -un) == rabbitmq ]]; } && rabbit_node_running; then
		local enabled
		enabled=$(timeout 30 rabbitmq-plugins list -e -m 2>/dev/null 9>&-) || enabled=""
		local p
		for p in "${RABBIT_PLUGINS[@]}"; do
			if ! grep -qx "$p" <<<"$enabled"; then
				log "enabling RabbitMQ plugin $p"
				timeout 60 rabbitmq-plugins enable "$p" >&2 9>&- || log "WARNING: could not enable $p; partitioned queues need it"
			fi
		done
	elif docker_engine_up && compose ps --status running rabbitmq 2>/dev/null | grep -q rabbitmq; then
		compose exec -T rabbitmq rabbitmq-plugins enable "${RABBIT_PLUGINS[@]}" >&2 9>&- ||
			log "WARNING: could not enable ${RABBIT_PLUGINS[*]} in the rabbitmq container"
	else
		log "note: partitioned queues need the RabbitMQ plugin(s) ${RABBIT_PLUGINS[*]}: rabbitmq-plugins enable ${RABBIT_PLUGINS[*]}"
	fi
}

# ---------------------------------------------------------- installation ---

install_packages() {
	local pkgs=("$@")
	local install_cmd="apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y ${pkgs[*]}"
	if ! is_root; then
		log "ERROR: ${pkgs[*]} not installed, no Docker engine answers, and installing needs root."
		log "Run (then run this script again):"
		log "    sudo sh -c '$install_cmd'"
		log "or run this script as root, which installs, configures and starts them:"
		log "    sudo $ROOT/deploy/local/ensure-services.sh"
		exit 1
	fi
	have apt-get || die "${pkgs[*]} not installed and apt-get not found; install PostgreSQL and RabbitMQ, or start a Docker engine"
	log "installing ${pkgs[*]}: $install_cmd"
	# 9>&-: a service started by a package's install script must not keep the lock.
	apt-get update >&2 9>&-
	DEBIAN_FRONTEND=noninteractive apt-get install -y "${pkgs[@]}" >&2 9>&-
}

configure_installed_postgres() {
	local ver name status
	read -r ver name status < <(pg_cluster) || true
	if [[ -z ${ver:-} ]]; then
		ver=$(pg_newest_version)
		name=main
		log "creating PostgreSQL cluster $ver/$name on port $PG_PORT"
		pg_createcluster "$ver" "$name" --port "$PG_PORT" >&2 9>&-
		status=down
	fi
	pg_trust_loopback "$ver" "$name"
	if [[ $status == online* ]]; then
		pg_ctlcluster --skip-systemctl-redirect "$ver" "$name" reload >&2 9>&-
	fi
}

configure_installed_rabbitmq() {
	# A node name that does not depend on the container's hostname resolving.
	local envf=/etc/rabbitmq/rabbitmq-env.conf
	if ! grep -qs '^[[:space:]]*NODENAME=' "$envf"; then
		log "configuring $envf: NODENAME=rabbit@localhost"
		mkdir -p /etc/rabbitmq
		printf '%s\n' '# idemq: a node name that does not depend on the hostname resolving' \
			'NODENAME=rabbit@localhost' >>"$envf"
	fi
}

# ------------------------------------------------------------------ wait ---

wait_ready() {
	local deadline=$((SECONDS + TIMEOUT)) pg_ok=0 amqp_ok=0 pg_auth_strikes=0 next_note=$((SECONDS + 10))
	while :; do
		((pg_ok)) || { pg_usable && pg_ok=1; } || true
		((amqp_ok)) || { amqp_usable && amqp_ok=1; } || true
		if ((pg_ok && amqp_ok)); then
			return 0
		fi
		# The server accepts connections but psql fails: waiting will not help.
		if ((!pg_ok)) && have psql && pg_accepting; then
			if ((++pg_auth_strikes >= 3)); then
				log "PostgreSQL accepts connections on $PG_HOST:$PG_PORT but 'psql -h $PG_HOST -U $PG_USER' fails:"
				printf '    %s\n' "${PG_ERR//$'\n'/$'\n    '}" >&2
				die "the project connects as user $PG_USER without a password; allow it (pg_hba.conf: 'host all postgres 127.0.0.1/32 trust', then reload)"
			fi
		else
			pg_auth_strikes=0
		fi
		if ((SECONDS >= deadline)); then
			((pg_ok)) || log "PostgreSQL not ready on $PG_HOST:$PG_PORT: $PG_ERR"
			((amqp_ok)) || log "RabbitMQ not ready on $AMQP_HOST:$AMQP_PORT: $AMQP_ERR"
			case $MODE in
			docker) log "see: docker compose -f deploy/docker-compose.yml logs postgres rabbitmq" ;;
			local) log "see: /var/log/postgresql/ and /var/log/rabbitmq/ ($RABBIT_START_LOG)" ;;
			esac
			die "services not ready after ${TIMEOUT}s"
		fi
		if ((SECONDS >= next_note)); then
			local waiting=()
			((pg_ok)) || waiting+=(PostgreSQL)
			((amqp_ok)) || waiting+=(RabbitMQ)
			log "waiting for ${waiting[*]} ($((deadline - SECONDS))s left)"
			next_note=$((SECONDS + 10))
		fi
		sleep 1
	done
}

# ensure_test_db: the integration tests use database "test" by default.
ensure_test_db() {
	have psql || return 0
	local q=(psql -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" -d postgres -w -X -A -t -q)
	if [[ $("${q[@]}" -c "select 1 from pg_database where datname = '$PG_TEST_DB'" 2>/dev/null) == 1 ]]; then
		return 0
	fi
	log "creating database $PG_TEST_DB"
	if ! "${q[@]}" -c "create database $PG_TEST_DB" >/dev/null 2>&1 &&
		[[ $("${q[@]}" -c "select 1 from pg_database where datname = '$PG_TEST_DB'" 2>/dev/null) != 1 ]]; then
		log "warning: could not create database $PG_TEST_DB; tests that use it will fail"
	fi
}

# ------------------------------------------------------------------ main ---

main() {
	[[ $TIMEOUT =~ ^[0-9]+$ ]] || die "IDEMQ_SERVICES_TIMEOUT must be a number of seconds, not '$TIMEOUT'"

	# One run at a time per user: two concurrent `make test` must not both
	# start a broker.
	if have flock && exec 9>>"${TMPDIR:-/tmp}/idemq-ensure-services.$EUID.lock"; then
		flock -w 300 9 || die "another ensure-services.sh holds the lock for 300s"
	fi

	if pg_usable && amqp_usable; then
		ensure_test_db
		ensure_rabbit_plugins
		log "PostgreSQL ($PG_HOST:$PG_PORT) and RabbitMQ ($AMQP_HOST:$AMQP_PORT) are up"
		return 0
	fi

	# Start only what does not answer at all; a port that answers but is not
	# usable yet (booting, misconfigured) is left alone and waited for.
	local need_pg=0 need_amqp=0
	port_open "$PG_HOST" "$PG_PORT" || need_pg=1
	port_open "$AMQP_HOST" "$AMQP_PORT" || need_amqp=1
	((need_pg)) && log "PostgreSQL does not answer on $PG_HOST:$PG_PORT"
	((need_amqp)) && log "RabbitMQ does not answer on $AMQP_HOST:$AMQP_PORT"

	if ((need_pg || need_amqp)); then
		if docker_engine_up; then
			local svcs=()
			((need_pg)) && svcs+=(postgres)
			((need_amqp)) && svcs+=(rabbitmq)
			start_with_docker "${svcs[@]}"
		else
			MODE=local
			local missing=()
			((need_pg)) && ! pg_installed && missing+=(postgresql)
			((need_amqp)) && ! rabbit_installed && missing+=(rabbitmq-server)
			if ((${#missing[@]})); then
				install_packages "${missing[@]}"
				if [[ " ${missing[*]} " == *" postgresql "* ]]; then
					pg_installed || die "postgresql installed but pg_ctlcluster or the server binary is missing"
					configure_installed_postgres
				fi
				if [[ " ${missing[*]} " == *" rabbitmq-server "* ]]; then
					rabbit_installed || die "rabbitmq-server installed but not found"
					# The package may have started the broker already.
					port_open "$AMQP_HOST" "$AMQP_PORT" || configure_installed_rabbitmq
				fi
			fi
			# Start each one that still does not answer (a package's install
			# script may have started it).
			((need_pg)) && ! port_open "$PG_HOST" "$PG_PORT" && start_local_postgres
			((need_amqp)) && ! port_open "$AMQP_HOST" "$AMQP_PORT" && start_local_rabbitmq
			if ((${#NEED_SUDO[@]})); then
				log "ERROR: starting the installed services needs root. Run:"
				printf '    sudo %s\n' "${NEED_SUDO[@]}" >&2
				log "or run this script as root: sudo $ROOT/deploy/local/ensure-services.sh"
				exit 1
			fi
		fi
	fi

	log "waiting up to ${TIMEOUT}s for PostgreSQL and RabbitMQ"
	wait_ready
	ensure_test_db
	ensure_rabbit_plugins
	log "PostgreSQL ($PG_HOST:$PG_PORT) and RabbitMQ ($AMQP_HOST:$AMQP_PORT) are up"
}

main "$@"
