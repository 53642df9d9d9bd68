#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite with real DeepSpeed on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# `pytest` (not `python -m pytest`) so that the installed package, with its native module, is imported
# rather than the source folder.
exec pytest "$@"
