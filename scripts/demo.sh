#!/usr/bin/env bash
# Sets up and runs the built-in example: DeepSpeed trains a tiny model on 2 CPU ranks and saves a ZeRO
# checkpoint; pyckpt converts it to Universal format; the result is checked against DeepSpeed's own
# converter, tensor by tensor.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
cd "${TMPDIR:-/tmp}"
exec python -m pyckpt.demo "$@"
