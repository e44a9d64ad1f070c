#!/usr/bin/env bash
# System packages some tests use: PostgreSQL (the store suite runs on a real server too) and Chromium (the curation
# UI test drives it headless through Playwright). Installs what is missing with apt-get when it can (root, or
# passwordless sudo); otherwise says what to install and those tests skip (CI sets ARLFLOW_REQUIRE_SYSTEM_TESTS=1,
# which turns the skips into failures).
set -uo pipefail
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "note: install ${need[*]} with your package manager to run the PostgreSQL and browser tests" >&2
  exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
  SUDO=""
elif sudo -n true 2>/dev/null; then
  SUDO="sudo -n"
else
  echo "note: run 'sudo apt-get install -y ${need[*]}' to run the PostgreSQL and browser tests" >&2
  exit 0
fi
echo "installing system packages: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
