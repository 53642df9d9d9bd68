#!/usr/bin/env bash
# Creates .venv with the pinned, tested versions (constraints.txt) and builds pyckpt into it.
# torch is pinned to the CPU build that pip finds on these machines; nothing multi-GB is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
# The constraints also reach pip's isolated build environment (scikit-build-core, pybind11) this way.
export PIP_CONSTRAINT="$PWD/constraints.txt"
python -m pip install --quiet torch numpy
python -m pip install --quiet ".[${PYCKPT_EXTRAS:-test}]"
if [ "${PYCKPT_EXTRAS:-test}" = test ]; then
    # torchtitan's wheel asks for a nightly torch: installed without dependencies, at the pins of
    # constraints.txt (what its Llama3 model, state-dict adapter and optimizer utilities import)
    python -m pip install --quiet --no-deps torchtitan spmd_types tyro docstring_parser
fi
