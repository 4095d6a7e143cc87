#!/usr/bin/env bash
# Install what the bridge test needs (tests/integration/test_appservice_bridge.py): Debian's
# ngIRCd (the IRC server, run on loopback by the test) and heisenbridge from PyPI, an IRC
# bridge built on the mautrix framework, in its own virtualenv (.venv-heisenbridge: its
# dependencies are not Tributary's). Each only when absent. Needs root (or sudo) for ngircd.
set -euo pipefail

HEISENBRIDGE_VERSION=1.15.4
VENV=.venv-heisenbridge
PYTHON=${PYTHON:-python3}

log() { printf 'install-bridge: %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

if ! command -v ngircd >/dev/null 2>&1; then
    log "installing ngircd"
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get -o DPkg::Lock::Timeout=600 update -qq
    as_root apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends ngircd >/dev/null
fi

if ! "$VENV/bin/python" -c "import heisenbridge, sys; sys.exit(heisenbridge.__version__ != '$HEISENBRIDGE_VERSION')" 2>/dev/null; then
    log "installing heisenbridge $HEISENBRIDGE_VERSION into $VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "heisenbridge==$HEISENBRIDGE_VERSION"
fi
