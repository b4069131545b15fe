#!/usr/bin/env bash
# Install cmlcluster and what it needs into .venv, on a fresh Debian machine (as root) or any
# machine with Python >= 3.10.
#
#   scripts/install.sh          the package: enough for local workers
#   scripts/install.sh tensorflow   the package and TensorFlow: the main job (cmlcluster demo)
#   scripts/install.sh dev      everything the test suite uses: TensorFlow, Horovod (built from
#                               source, cached), Debian's Docker engine, sshd and chromium, the test image
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
dev=false
[[ ",$extras," == *",dev,"* ]] && dev=true

apt_install() {
    command -v apt-get >/dev/null || { echo "install.sh: install $* first (no apt-get here)" >&2; exit 1; }
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"
}

missing=()
command -v python3 >/dev/null 2>&1 || missing+=(python3)
python3 -c "import venv, ensurepip" >/dev/null 2>&1 || missing+=(python3-venv)
if $dev; then
    # cmake, g++: the Horovod build. openssh-server: sshd in workers. docker.io: the docker backend.
    # chromium: the browser tests (tests/browser), driven by Playwright; never Playwright's own download.
    for tool in cmake:cmake g++:g++ /usr/sbin/sshd:openssh-server dockerd:docker.io chromium:chromium; do
        command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool##*:}")
    done
fi
if [ "${#missing[@]}" -gt 0 ]; then
    apt_install "${missing[@]}"
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"

if $dev; then
    bash scripts/build_horovod.sh
    bash scripts/docker_engine.sh  # starts dockerd when none answers; makes the test image
fi
