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
# The test build (the default, PYCKPT_EXTRAS=test) compiles the native test hooks, pyckpt._core.testing, that the
# tests drive; any other set of extras, or PYCKPT_TESTING=OFF, installs the release build without them, as a
# plain `pip install .` does (CMakeLists.txt, option PYCKPT_TESTING).
if [ "${PYCKPT_EXTRAS:-test}" = test ]; then TESTING=${PYCKPT_TESTING:-ON}; else TESTING=${PYCKPT_TESTING:-OFF}; fi
python -m pip install --quiet -C cmake.define.PYCKPT_TESTING="$TESTING" ".[${PYCKPT_EXTRAS:-test}]"
if [ "${PYCKPT_EXTRAS:-test}" = test ]; then
    # torchtitan's wheel asks for a nightly torch: installed without dependencies, at the pins of
    # constraints.txt (what its Llama3 model, state-dict adapter and optimizer utilities import)
    python -m pip install --quiet --no-deps torchtitan spmd_types tyro docstring_parser
    # Lightning's DeepSpeedStrategy.save_checkpoint (tests/deepspeed/save/test_enable_save.py): its own code,
    # without the dependencies its Trainer needs (the strategy refuses CPU, so only that function runs)
    python -m pip install --quiet --no-deps lightning lightning-utilities torchmetrics
    # TRL's SFTTrainer with a PEFT LoRA model (tests/deepspeed/save/test_trl_client.py), with datasets, which TRL
    # reads its training data through
    python -m pip install --quiet trl peft datasets
fi
