#!/usr/bin/env bash
# Install what the observability and deployment tests run, when absent:
#   prometheus      - Debian's Prometheus server (tests/integration/test_prometheus.py
#                     starts it directly, with its own port and data directory);
#   nginx           - for the worker routing tests (issue 9);
#   docker-compose  - validates docker/compose.yml (`docker-compose config`;
#                     no container engine is needed for that).
# apt must not start the packaged system services: they would take ports
# (nginx :80, prometheus :9090) and data directories the tests do not use.
# A policy-rc.d that refuses every start is put in place for the install only.
set -euo pipefail

log() { printf 'install-observability: %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
command -v prometheus >/dev/null 2>&1 || [ -x /usr/bin/prometheus ] || missing+=(prometheus)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx)
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null 2>&1; then
    missing+=(docker-compose)
fi
[ "${#missing[@]}" -eq 0 ] && exit 0

log "installing ${missing[*]}"
policy=/usr/sbin/policy-rc.d
restore_policy=""
if [ -e "$policy" ]; then
    restore_policy="$(mktemp)"
    as_root cp -p "$policy" "$restore_policy"
fi
cleanup() {
    if [ -n "$restore_policy" ]; then
        as_root cp -p "$restore_policy" "$policy"
        rm -f "$restore_policy"
    else
        as_root rm -f "$policy"
    fi
}
trap cleanup EXIT
printf '#!/bin/sh\n# install-observability.sh: do not start services during the install\nexit 101\n' \
    | as_root tee "$policy" >/dev/null
as_root chmod 755 "$policy"

as_root apt-get update -qq
as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null

for tool in "${missing[@]}"; do
    case "$tool" in
        prometheus) [ -x /usr/bin/prometheus ] || { log "prometheus did not install"; exit 1; } ;;
        nginx) [ -x /usr/sbin/nginx ] || { log "nginx did not install"; exit 1; } ;;
        docker-compose) command -v docker-compose >/dev/null 2>&1 || { log "docker-compose did not install"; exit 1; } ;;
    esac
done
log "done"
