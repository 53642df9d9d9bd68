#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite with real DeepSpeed on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# `pytest` (not `python -m pytest`) so that the installed package, with its native module, is imported
# rather than the source folder.
# Two processes, each test file on one of them (its fixtures built once): most of the suite's time
# is DeepSpeed launches whose ranks leave a core idle, so two files at once take ~0.6x the time of
# one after the other (measured on a 2-core machine). PYCKPT_TEST_PROCESSES=0 runs in this process.
N=${PYCKPT_TEST_PROCESSES:-2}
if [ "$N" = 0 ]; then exec pytest "$@"; fi
exec pytest -n "$N" --dist loadfile "$@"
