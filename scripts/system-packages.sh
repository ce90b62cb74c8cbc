#!/usr/bin/env bash
# The Debian packages some tests need besides Python's: redis-server (the remote tier's tests start their own),
# chromium and chromium-driver (the gateway's page in a headless browser), systemd (systemd-analyze verifies the
# units). Installed where this user may (root with apt-get, as on CI machines); otherwise named here, and the
# tests that need them are skipped, each skip naming its package (tests/system_packages.py).
set -uo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "Installing the Debian packages the tests need: ${need[*]}"
  if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null; then
    exit 0
  fi
  echo "kvpool: apt-get could not install ${need[*]}; the tests that need them will be skipped." >&2
else
  echo "kvpool: ${need[*]} not installed and this user cannot apt-get; the tests that need them will be" \
    "skipped (sudo apt-get install ${need[*]})." >&2
fi
exit 0
