#!/usr/bin/env bash
# Tests start their own redis-server on a free port; this makes sure the binary exists,
# installing it from the distribution's packages when it does not.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    SUDO="sudo"
fi
if command -v apt-get >/dev/null 2>&1; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
elif command -v dnf >/dev/null 2>&1; then
    $SUDO dnf install -y -q redis
elif command -v apk >/dev/null 2>&1; then
    $SUDO apk add --quiet redis
fi
command -v redis-server >/dev/null 2>&1 || { echo "redis-server is required by the tests and could not be installed" >&2; exit 1; }
