#!/usr/bin/env bash
# Install Debian's Chromium and its WebDriver, when absent, for the operator console test
# (tests/integration/test_admin_console.py drives it headless through Selenium, pointed at
# /usr/bin/chromium and /usr/bin/chromedriver; Selenium never downloads a browser).
# Needs root (or sudo); without root, install the two packages some other way first.
set -euo pipefail

log() { printf 'install-browser: %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

[ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ] && exit 0
log "installing chromium chromium-driver"
export DEBIAN_FRONTEND=noninteractive
as_root apt-get -o DPkg::Lock::Timeout=600 update -qq
as_root apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
