#!/usr/bin/env bash
# Sets up and runs the built-in example, a checkpoint's whole life (pyckpt/demo.py): DeepSpeed trains a
# small Llama with a locally built tokenizer on 2 CPU ranks and saves through pyckpt's save glue; torchrun
# converts it to Universal format with 2 processes (checked against DeepSpeed's converter, tensor by
# tensor); pyckpt exports it for Hugging Face; transformers loads the export (logits checked bit for
# bit); DeepSpeed resumes on 3 ranks through pyckpt's accelerated loader (state checked).
set -euo pipefail
cd "$(dirname "$0")/.."
# The test extras (DeepSpeed, transformers, tokenizers) with the release build of the native module, as a
# user's install has it: no test hooks (scripts/setup.sh; scripts/test.sh installs the test build again).
PYCKPT_TESTING=OFF bash scripts/setup.sh
. .venv/bin/activate
cd "${TMPDIR:-/tmp}"
exec python -m pyckpt.demo "$@"
