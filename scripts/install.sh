#!/usr/bin/env bash
# Install cmlcluster and what it needs into .venv, on a fresh Debian machine (as root) or any
# machine with Python >= 3.10.
#
#   scripts/install.sh          the package: enough for local workers
#   scripts/install.sh tensorflow   the package, and TensorFlow unless .venv has one: the main job
#   scripts/install.sh dev      everything the test suite uses: TensorFlow, Horovod (built from
#                               source, cached), Debian's Docker engine, sshd and chromium, the test image,
#                               and .venv-tf2.21, where the TensorFlow tests run again on TensorFlow 2.21
# Other words are the package's extras (widgets, docker, pytorch, ...), comma-separated.
# Any words, in any order, any number of times: whatever TensorFlow .venv holds keeps its own requirements
# (every pip install into .venv names it, pinned: scripts/tensorflow_pins.py), and each run ends with pip check.
set -euo pipefail
cd "$(dirname "$0")/.."
words="${1:-}"
dev=false tensorflow=false extras=()
IFS=, read -ra asked <<< "$words"
for word in "${asked[@]}"; do
    case "$word" in
        dev) dev=true tensorflow=true; extras+=(dev) ;;
        # cmlcluster uses the TensorFlow it finds and never installs a second one (docs/guide/tensorflow.md, "TensorFlow
        # versions"), so TensorFlow is no extra of the package: it is installed here where there is none.
        tensorflow) tensorflow=true ;;
        *) extras+=("$word") ;;
    esac
done
extras=$(IFS=,; echo "${extras[*]}")
# The TensorFlow installed where there is none, and the tests' (Horovod 0.28.1 builds against <= 2.15).
# TensorBoard 2.15 imports pkg_resources, which setuptools 81 dropped (torch asks for setuptools >= 77).
TENSORFLOW=(tensorflow-cpu==2.15.1 "numpy<2" "setuptools<81")
NEWEST_TENSORFLOW=tensorflow-cpu==2.21.0 NEWEST_TF_KERAS=tf-keras==2.21.0  # .venv-tf2.21

apt_install() {
    command -v apt-get >/dev/null || { echo "install.sh: install $* first (no apt-get here)" >&2; exit 1; }
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"
}

missing=()
command -v python3 >/dev/null 2>&1 || missing+=(python3)
python3 -c "import venv, ensurepip" >/dev/null 2>&1 || missing+=(python3-venv)
if $dev; then
    # cmake, g++: the Horovod build. openssh-server: sshd in workers; openssh-client: ssh to SSH hosts and a
    # Slurm login node. docker.io: the docker backend.
    # chromium: the browser tests (tests/browser), driven by Playwright; never Playwright's own download.
    # setsid, unshare, setpriv, nsenter (util-linux): dockerd in a session of its own (docker_engine.sh), a PID
    # namespace of its own for the cleanup tests, another uid for sshd's and the strangers' tests, a second
    # network's interface renamed inside an SSH test host.
    # iptables: the Kubernetes stand-in enforces NetworkPolicies with it.
    for tool in cmake:cmake g++:g++ /usr/sbin/sshd:openssh-server ssh:openssh-client dockerd:docker.io chromium:chromium setsid:util-linux unshare:util-linux setpriv:util-linux nsenter:util-linux iptables:iptables iptables-restore:iptables; do
        command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool##*:}")
    done
    # libnss-wrapper: sshd in a worker whose uid has no /etc/passwd entry (Docker as the user's uid, pods).
    compgen -G "/usr/lib/*/libnss_wrapper.so" >/dev/null || compgen -G "/usr/lib*/libnss_wrapper.so" >/dev/null \
        || missing+=(libnss-wrapper)
fi
if [ "${#missing[@]}" -gt 0 ]; then
    apt_install "${missing[@]}"
fi
# slurmctld, slurmd, slurm-client, munge: the tests' Slurm cluster (tests/harness/slurm.py), in containers,
# with a munged of its own. Their services must not start on install: where no policy-rc.d says so
# already (as in Docker's Debian images), one refuses every start for this apt run, and goes after it.
if $dev && ! command -v slurmctld >/dev/null 2>&1 && ! [ -x /usr/sbin/slurmctld ]; then
    policy=/usr/sbin/policy-rc.d made_policy=false
    if [ ! -e "$policy" ] && command -v apt-get >/dev/null; then
        printf '#!/bin/sh\nexit 101\n' > "$policy"
        chmod 755 "$policy"
        made_policy=true
        trap 'rm -f "$policy"' EXIT
    fi
    apt_install slurmctld slurmd slurm-client munge
    if $made_policy; then
        rm -f "$policy"
        trap - EXIT
    fi
fi

# pip check of a venv; $2: a pattern of the lines a --no-deps install makes on purpose.
pip_check() {
    local out
    out=$("$1/bin/python" -m pip check 2>&1) && return 0
    out=$(grep -v -e "${2:-^$}" <<< "$out") || return 0
    printf 'install.sh: %s has broken requirements:\n%s\n' "$1" "$out" >&2
    exit 1
}

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
# pip resolves only what it is asked for and its requirements, and would upgrade TensorFlow's (numpy, ...)
# under it for an extra that asks for newer ones: the TensorFlow that .venv holds, pinned, enters every
# install (a broken one is repaired); where there is none and one is asked for, the one installed here.
tf_pins=$(.venv/bin/python scripts/tensorflow_pins.py)
read -ra pins <<< "$tf_pins"
if $tensorflow && [ "${#pins[@]}" -eq 0 ]; then
    pins=("${TENSORFLOW[@]}")
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}" "${pins[@]}"
# The JupyterLab panel's data files, which an editable install leaves out (the script says why).
.venv/bin/python scripts/link_labextension.py >/dev/null
# The package's bytecode, which an editable install does not write: where PYTHONDONTWRITEBYTECODE is set,
# every worker's agent would otherwise compile what it imports of cmlcluster at each start (80 ms of CPU).
.venv/bin/python -m compileall -q cmlcluster >/dev/null

if $dev; then
    # The newest TensorFlow beside the pinned one, for tests/integration/test_tensorflow_versions.py.
    # tf-keras (Keras 2, for parameter-server model.fit) asks for the distribution named tensorflow:
    # --no-deps keeps pip from adding it over tensorflow-cpu.
    [ -x .venv-tf2.21/bin/python ] || python3 -m venv .venv-tf2.21
    .venv-tf2.21/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
    .venv-tf2.21/bin/python -m pip install -q --disable-pip-version-check -e ".[docker]" \
        "$NEWEST_TENSORFLOW" "pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.5" "psutil>=5.9"
    .venv-tf2.21/bin/python -m pip install -q --disable-pip-version-check --no-deps "$NEWEST_TF_KERAS"
    pip_check .venv-tf2.21 "^tf-keras [^ ]* requires tensorflow, which is not installed"
    bash scripts/build_horovod.sh  # against .venv's TensorFlow, pinned as above
    bash scripts/docker_engine.sh  # starts dockerd when none answers; makes the test image
fi
pip_check .venv
