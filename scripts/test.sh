#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite with real DeepSpeed on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# `pytest` (not `python -m pytest`) so that the installed package, with its native module, is imported
# rather than the source folder.
# Three processes, each test file on one of them (its fixtures built once; the checkpoints several
# files share are built once for all of them, tests/conftest.py:built_once): most of the suite's time
# is DeepSpeed launches whose ranks wait on each other and leave a core idle. On a 2-core machine two
# processes kept 1.1-1.2 cores busy on average (17:35 for the suite); three with the shared build keep
# 1.97 busy (16:06, four more tests). PYCKPT_TEST_PROCESSES=0 runs in this process.
N=${PYCKPT_TEST_PROCESSES:-3}
if [ "$N" = 0 ]; then exec pytest "$@"; fi
exec pytest -n "$N" --dist loadfile "$@"
