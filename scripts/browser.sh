#!/usr/bin/env bash
# Make sure headless Chromium and its WebDriver are installed, for the
# dashboard's browser test. Installs the Debian packages when either is missing.
set -euo pipefail

CHROMIUM=${PAYHOOK_CHROMIUM:-/usr/bin/chromium}
CHROMEDRIVER=${PAYHOOK_CHROMEDRIVER:-/usr/bin/chromedriver}

if [ -x "$CHROMIUM" ] && [ -x "$CHROMEDRIVER" ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "browser: $CHROMIUM or $CHROMEDRIVER is missing; run as root or install chromium and chromium-driver" >&2
  exit 1
fi
echo "browser: installing chromium and chromium-driver from Debian packages" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  chromium chromium-driver fonts-dejavu-core >/dev/null
"$CHROMIUM" --version >&2
