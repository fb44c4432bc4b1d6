#!/usr/bin/env bash
# Make sure PostgreSQL and Redis answer on 127.0.0.1; start local servers when
# they do not. Used by `make test` and `make run` on a fresh machine.
set -euo pipefail

PGHOST=${PGHOST:-127.0.0.1}
PGPORT=${PGPORT:-5432}
REDIS_PORT=${REDIS_PORT:-6379}

pg_up() { pg_isready -q -h "$PGHOST" -p "$PGPORT" 2>/dev/null; }
# pg_isready does not log in: this does, as the tests and `make run` will.
pg_login() {
  PGPASSWORD= psql -w -h "$PGHOST" -p "$PGPORT" -U postgres -d postgres -Atqc 'select 1' \
    >/dev/null 2>&1
}
redis_up() { redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG; }

wait_for() {
  local what=$1 check=$2
  for _ in $(seq 1 60); do
    if $check; then return 0; fi
    sleep 0.5
  done
  echo "services: $what did not come up" >&2
  return 1
}

if ! command -v pg_isready >/dev/null || ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
  echo "services: installing PostgreSQL from Debian packages" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
fi
if ! command -v redis-server >/dev/null; then
  echo "services: installing Redis from Debian packages" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi

# The scale-out tests start their own: PgBouncer in front of PostgreSQL, and
# Redis Sentinels watching a master and its replica.
missing=()
[ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
command -v redis-sentinel >/dev/null || missing+=(redis-sentinel)
if [ ${#missing[@]} -gt 0 ]; then
  echo "services: installing ${missing[*]} from Debian packages" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! pg_up; then
  echo "services: starting PostgreSQL on $PGHOST:$PGPORT" >&2
  # A Debian cluster on this port, if there is one and it starts; else our own.
  started=no
  if command -v pg_lsclusters >/dev/null; then
    cluster=$(pg_lsclusters -h 2>/dev/null | awk -v port="$PGPORT" '$3 == port {print $1, $2; exit}')
    if [ -n "$cluster" ] && pg_ctlcluster --skip-systemctl-redirect $cluster start; then
      started=yes
      # Debian's clusters ask a password over TCP (scram-sha-256); payhook's
      # local URLs carry none: trust the postgres user from 127.0.0.1 only.
      if wait_for PostgreSQL pg_up 2>/dev/null && ! pg_login; then
        hba=$(pg_conftool $cluster show -s hba_file 2>/dev/null ||
          ls "/etc/postgresql/${cluster// //}/pg_hba.conf" 2>/dev/null || true)
        line="host all postgres 127.0.0.1/32 trust"
        if [ -n "$hba" ] && ! grep -qxF "$line" "$hba"; then
          echo "services: trusting postgres from 127.0.0.1 in $hba" >&2
          sed -i "1i $line" "$hba"
          pg_ctlcluster --skip-systemctl-redirect $cluster reload
        fi
      fi
    fi
  fi
  if [ "$started" = no ] || ! wait_for PostgreSQL pg_up 2>/dev/null; then
    # No Debian cluster: a throwaway one with trust auth, owned by `postgres`.
    bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
    data=${PAYHOOK_PGDATA:-/var/tmp/payhook-pgdata}
    id postgres >/dev/null 2>&1 || useradd --system --home "$data" postgres
    mkdir -p "$data" && chown postgres "$data"
    as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
    [ -f "$data/PG_VERSION" ] || as_pg "$bin/initdb" -D "$data" -U postgres --auth=trust >/dev/null
    as_pg "$bin/pg_ctl" -D "$data" -l "$data/server.log" -w \
      -o "-c listen_addresses=$PGHOST -p $PGPORT -k /tmp" start >/dev/null
    wait_for PostgreSQL pg_up
  fi
fi

if ! redis_up; then
  echo "services: starting Redis on 127.0.0.1:$REDIS_PORT" >&2
  mkdir -p /var/tmp/payhook-redis
  redis-server --daemonize yes --bind 127.0.0.1 --port "$REDIS_PORT" \
    --dir /var/tmp/payhook-redis --appendonly yes --appendfsync always \
    --logfile /var/tmp/payhook-redis/redis.log
  wait_for Redis redis_up
fi
if ! pg_login; then
  echo "services: PostgreSQL on $PGHOST:$PGPORT answers but refuses user postgres" \
    "without a password; set PAYHOOK_TEST_PG (tests) or DATABASE_URL" >&2
fi
echo "services: PostgreSQL and Redis answer" >&2
