#!/usr/bin/env bash
# The status-page test renders the page in headless Chromium (tests/browser_support.py); this
# makes sure Debian's `chromium` exists, installing it from the distribution's packages when
# it does not. Under CI=true a missing browser fails here (and the test would fail too);
# locally it warns and the browser tests skip with a reason.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    SUDO="sudo"
fi
if command -v apt-get >/dev/null 2>&1; then
    $SUDO apt-get update -qq || true
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null || true
elif command -v dnf >/dev/null 2>&1; then
    $SUDO dnf install -y -q chromium || true
elif command -v apk >/dev/null 2>&1; then
    $SUDO apk add --quiet chromium || true
fi
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
case "$(printf '%s' "${CI:-}" | tr '[:upper:]' '[:lower:]')" in
    1|true|yes|on) echo "error: chromium could not be installed and CI is set: the status-page test cannot run" >&2; exit 1;;
    *) echo "warning: chromium not installable here: browser tests will skip" >&2;;
esac
