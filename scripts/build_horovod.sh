#!/usr/bin/env bash
# Build Horovod 0.28.1 from PyPI's sdist against the TensorFlow in .venv, with Gloo
# (no MPI needed), and install it. The build takes ~9 minutes on 2 cores, so the
# wheel is kept in a cache keyed by the TensorFlow and Python versions it was built for.
# Usage: scripts/build_horovod.sh   (after TensorFlow is installed in .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
HOROVOD_VERSION=0.28.1
py=.venv/bin/python

if $py -c "import horovod.tensorflow" >/dev/null 2>&1 \
    && [ "$($py -c 'import horovod; print(horovod.__version__)')" = "$HOROVOD_VERSION" ]; then
    exit 0
fi
for tool in cmake g++; do
    command -v "$tool" >/dev/null || { echo "build_horovod.sh: $tool is missing (apt-get install cmake g++)" >&2; exit 1; }
done
err=$(mktemp)
trap 'rm -f "$err"' EXIT
tf=$($py -c "import tensorflow as tf; print(tf.__version__)" 2>"$err") || {
    echo "build_horovod.sh: TensorFlow does not import in .venv ($(tail -1 "$err"));" \
        "scripts/install.sh tensorflow installs tensorflow-cpu==2.15.1 (or repairs the one there)" >&2; exit 1; }
if [ "$(printf '%s\n' "$tf" 2.15.99 | sort -V | tail -1)" != 2.15.99 ]; then
    echo "build_horovod.sh: Horovod $HOROVOD_VERSION builds against TensorFlow <= 2.15, and .venv has $tf;" \
        "use a venv with tensorflow-cpu==2.15.1 (or tensorflow==2.15.1) for Horovod" >&2
    exit 1
fi
pyver=$($py -c "import sys; print(f'{sys.version_info[0]}{sys.version_info[1]}')")
cache="${CMLCLUSTER_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cmlcluster/wheels}/horovod-$HOROVOD_VERSION-tf$tf-py$pyver"
mkdir -p "$cache"

if ! ls "$cache"/horovod-*.whl >/dev/null 2>&1; then
    echo "building horovod $HOROVOD_VERSION against TensorFlow $tf (about 9 minutes on 2 cores)..."
    # Build against the installed TensorFlow (no isolation); Gloo is Horovod's own controller,
    # so horovodrun needs neither MPI nor a rendezvous server of ours.
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
        $py -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-cache-dir --no-deps \
            -w "$cache.tmp" "horovod==$HOROVOD_VERSION"
    mv "$cache.tmp"/horovod-*.whl "$cache"/ && rm -rf "$cache.tmp"
fi
# With the installed TensorFlow pinned, as scripts/install.sh does: Horovod's requirements are resolved
# with TensorFlow's, never upgrading those under it.
tf_pins=$($py scripts/tensorflow_pins.py)
read -ra pins <<< "$tf_pins"
$py -m pip install -q --disable-pip-version-check "$cache"/horovod-*.whl "${pins[@]}"
.venv/bin/horovodrun --check-build
