#!/usr/bin/env bash
# Tools the operator tests drive, installed from Debian packages when missing:
# headless Chromium and its WebDriver (the dashboard's browser test), and
# promtool (the Prometheus alert rules' checks and unit tests). promtool is
# taken out of the `prometheus` package without installing it, so no
# Prometheus server is set up or started.
set -euo pipefail

CHROMIUM=${PAYHOOK_CHROMIUM:-/usr/bin/chromium}
CHROMEDRIVER=${PAYHOOK_CHROMEDRIVER:-/usr/bin/chromedriver}
PROMTOOL_DIR=${PAYHOOK_PROMTOOL_DIR:-/usr/local/bin}

need_root() {
  if [ "$(id -u)" != 0 ]; then
    echo "browser: $1 is missing; run as root or install it yourself" >&2
    exit 1
  fi
}

if [ ! -x "$CHROMIUM" ] || [ ! -x "$CHROMEDRIVER" ]; then
  need_root "chromium or chromium-driver"
  echo "browser: installing chromium and chromium-driver from Debian packages" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    chromium chromium-driver fonts-dejavu-core >/dev/null
fi

if ! command -v promtool >/dev/null; then
  need_root "promtool"
  echo "browser: extracting promtool from Debian's prometheus package" >&2
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && apt-get download -qq prometheus 2>/dev/null || {
    apt-get update -qq && apt-get download -qq prometheus; })
  dpkg-deb -x "$work"/prometheus_*.deb "$work/root"
  install -m 0755 "$work/root/usr/bin/promtool" "$PROMTOOL_DIR/promtool"
fi
