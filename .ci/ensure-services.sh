#!/usr/bin/env bash
# Make sure the services the tests use are reachable on 127.0.0.1:
# PostgreSQL on 5432 (user postgres, trust auth) and Redis on 6379.
# Start them when installed but stopped; install them with apt-get when absent.
set -euo pipefail

log() { printf 'ensure-services: %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

apt_updated=0
apt_install() {
    if [ "$apt_updated" -eq 0 ]; then as_root apt-get update -qq; apt_updated=1; fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

postgres_ok() { PGCONNECT_TIMEOUT=3 psql -h 127.0.0.1 -p 5432 -U postgres -d postgres -Atc 'select 1' >/dev/null 2>&1; }
redis_ok() { redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; }

ensure_postgres() {
    postgres_ok && return 0
    if ! command -v pg_ctlcluster >/dev/null 2>&1 || [ -z "$(ls /etc/postgresql 2>/dev/null)" ]; then
        log "installing PostgreSQL"
        apt_install postgresql postgresql-client
    fi
    local version
    version=$(ls /etc/postgresql | sort -n | tail -1)
    local hba="/etc/postgresql/$version/main/pg_hba.conf"
    # The tests connect as postgres over TCP without a password.
    if ! as_root grep -qE '^host\s+all\s+all\s+127\.0\.0\.1/32\s+trust' "$hba"; then
        log "allowing trust auth on 127.0.0.1 in $hba"
        as_root sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
    fi
    log "starting PostgreSQL $version"
    as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start 2>/dev/null \
        || as_root pg_ctlcluster --skip-systemctl-redirect "$version" main reload
    for _ in $(seq 1 50); do postgres_ok && return 0; sleep 0.2; done
    log "PostgreSQL did not become reachable on 127.0.0.1:5432"; return 1
}

ensure_redis() {
    command -v redis-cli >/dev/null 2>&1 || { log "installing Redis"; apt_install redis-server; }
    redis_ok && return 0
    log "starting Redis"
    as_root mkdir -p /var/lib/redis /var/log/redis
    as_root redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/ci.log
    for _ in $(seq 1 50); do redis_ok && return 0; sleep 0.2; done
    log "Redis did not become reachable on 127.0.0.1:6379"; return 1
}

command -v psql >/dev/null 2>&1 || { log "installing the PostgreSQL client"; apt_install postgresql-client; }
ensure_postgres
ensure_redis
