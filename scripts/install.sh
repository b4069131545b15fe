#!/usr/bin/env bash
# Install cmlcluster and what it needs into .venv, on a fresh Debian machine (as root) or any
# machine with Python >= 3.10. Usage: scripts/install.sh [extra,...]   e.g. scripts/install.sh dev
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"

missing=()
command -v python3 >/dev/null 2>&1 || missing+=(python3)
python3 -c "import venv, ensurepip" >/dev/null 2>&1 || missing+=(python3-venv)
if [ "${#missing[@]}" -gt 0 ]; then
    command -v apt-get >/dev/null || { echo "install ${missing[*]} first" >&2; exit 1; }
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
