#!/usr/bin/env bash
# Install the JavaScript client the sliding sync interoperability test drives
# (tests/integration/test_sliding_sync_js.py): matrix-js-sdk, unmodified, at the version
# tests/js_client/package-lock.json pins, into tests/js_client/node_modules. Needs Node.js 20+
# and npm (Debian's nodejs and npm packages); installs them when absent and root is available.
set -euo pipefail

log() { printf 'install-js-client: %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

cd "$(dirname "$0")/../tests/js_client"
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    log "installing nodejs npm"
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get -o DPkg::Lock::Timeout=600 update -qq
    as_root apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends nodejs npm >/dev/null
fi
# Reinstall only when the lock file changed since the last install.
stamp=node_modules/.installed-from-lock
if [ -f "$stamp" ] && cmp -s package-lock.json "$stamp"; then
    exit 0
fi
log "npm ci (matrix-js-sdk, as package-lock.json pins it)"
npm ci --no-audit --no-fund --loglevel=error
cp package-lock.json "$stamp"
