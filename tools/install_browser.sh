#!/usr/bin/env bash
# Chromium and its WebDriver from Debian's packages, for the dashboard's browser test
# (tests/server/test_dashboard_browser.py). Best effort: where they cannot be installed (not root,
# no apt), the test is skipped and says why. Set-up (`make setup`) runs this.
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "no Chromium here and no root apt-get to install it: the dashboard's browser test will be skipped" >&2
  exit 0
fi
echo "installing Chromium and chromedriver (Debian packages) for the dashboard's browser test" >&2
apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null \
  || echo "Chromium could not be installed: the dashboard's browser test will be skipped" >&2
exit 0
