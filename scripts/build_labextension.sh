#!/usr/bin/env bash
# Build the JupyterLab panel's TypeScript (labextension/) into the prebuilt extension the package ships
# (cmlcluster/lab/labextension/, committed: installing cmlcluster and running CI need no node), and record
# the sources' hash beside it (tests/unit/lab/test_panel_data.py fails when a source changed since).
#
#   bash scripts/build_labextension.sh        needs node >= 18 and npm (Debian's nodejs), and .venv
#
# @jupyterlab/builder's own build script, given the installed JupyterLab's core (its staging folder, which
# names the shared packages and their versions), as `jupyter labextension build` ran it up to JupyterLab
# 4.5 (4.6 hands that command to jupyter-builder, which fetches a @jupyterlab/core-meta of the builder's
# version from the network). After a build, `pip install -e .` (scripts/install.sh) installs the new bundle.
set -euo pipefail
cd "$(dirname "$0")/.."
for tool in node npm; do
    command -v "$tool" >/dev/null || { echo "build_labextension.sh: $tool not found (apt-get install nodejs npm)" >&2; exit 1; }
done
core=$(.venv/bin/python -c 'import jupyterlab, os; print(os.path.join(os.path.dirname(jupyterlab.__file__), "staging"))')
(
    cd labextension
    npm ci --no-audit --no-fund --loglevel=error
    rm -rf lib tsconfig.tsbuildinfo ../cmlcluster/lab/labextension
    node_modules/.bin/tsc
    node node_modules/@jupyterlab/builder/lib/build-labextension.js --core-path "$core" .
    cp install.json ../cmlcluster/lab/labextension/  # `jupyter labextension list`: installed by pip, as cmlcluster
)
.venv/bin/python scripts/labextension_sources.py --write
