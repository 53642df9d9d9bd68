#!/usr/bin/env bash
# The compatibility run, not part of the suite: a second environment (.venv-compat, or PYCKPT_COMPAT_VENV) with the
# newest torch, transformers, accelerate, Lightning, TRL and PEFT the package index serves (DeepSpeed and the rest
# stay at constraints.txt's pins), pyckpt built into it, and the tests of pyckpt's framework integrations run there.
# A failure here is a finding about a newer release (which patch, and why), not a broken build: the suite itself
# runs on the pins. Arguments replace the default test files; the log goes to $VENV/compat.log.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${PYCKPT_COMPAT_VENV:-.venv-compat}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" || exit 1
VENV=$(cd "$VENV" && pwd)
. "$VENV/bin/activate"

# The packages taken newest, and those whose versions move with them (tokenizers, the hub client, safetensors and
# datasets follow transformers and TRL; Lightning's own utilities follow it); every other pin is kept.
NEWEST="torch transformers tokenizers huggingface_hub safetensors accelerate lightning lightning-utilities
        torchmetrics trl peft datasets pyarrow pandas"
CONSTRAINTS="$VENV/constraints.txt"
pattern=$(printf '%s\n' $NEWEST | sed 's/[-_]/[-_]/g' | paste -sd'|')
grep -viE "^($pattern)[=<>~! ]" constraints.txt > "$CONSTRAINTS"
# PIP_CONSTRAINT replaces a constraint file named in pip's own configuration (here, the cap at the torch releases
# that lie on this machine's disk, so that no multi-GB build is downloaded): carry its lines over.
python -m pip config list 2>/dev/null | sed -n "s/^global\.constraint='\(.*\)'$/\1/p" | sort -u | while read -r machine; do
    [ -f "$machine" ] && grep -v '^#' "$machine" >> "$CONSTRAINTS"
done
export PIP_CONSTRAINT="$CONSTRAINTS"

python -m pip install --quiet --upgrade torch numpy || exit 1
python -m pip install --quiet --upgrade transformers tokenizers accelerate trl peft datasets lightning || exit 1
python -m pip install --quiet -C cmake.define.PYCKPT_TESTING=ON ".[test]" || exit 1
# torchtitan stays at its pin, without dependencies, as in scripts/setup.sh (tests/huggingface/test_hf_client.py)
python -m pip install --quiet --no-deps torchtitan spmd_types tyro docstring_parser || exit 1
python -m pip list 2>/dev/null | grep -iE '^(torch|transformers|tokenizers|accelerate|lightning|trl|peft|datasets|deepspeed|torchtitan|huggingface.hub|safetensors) ' \
    | tee "$VENV/versions.txt"

# The tests where pyckpt meets the frameworks: the Trainer, accelerate and Lightning saves (test_enable_save), TRL's
# SFTTrainer with PEFT LoRA (test_trl_client), the Trainer's memory tier (test_memory_trainer), stock transformers
# and accelerate as the oracle of what a save keeps (test_framework_against_stock), the patches' guards and the
# staged folders (test_framework_patch, test_framework_folders), and transformers/torchtitan loading pyckpt's exports
# (test_hf_client). The DeepSpeed-only tests are left out: DeepSpeed is at its pin here as in the suite.
if [ $# -eq 0 ]; then
    set -- tests/deepspeed/save/test_framework_patch.py tests/deepspeed/save/test_framework_folders.py \
        tests/deepspeed/save/test_framework_against_stock.py tests/deepspeed/save/test_trl_client.py \
        tests/deepspeed/save/test_enable_save.py tests/deepspeed/tiers/test_memory_trainer.py \
        tests/huggingface/test_hf_client.py
fi
# The newest releases are ones pyckpt's patches were not proven on, which would leave each framework stock with a
# warning: accept them, so that the run tries every patch on them (pyckpt/deepspeed/integrations/patching.py)
export PYCKPT_UNPROVEN_OK=${PYCKPT_UNPROVEN_OK:-all}
# `pytest` from the compatibility environment, so that its installed pyckpt (with the native module) is imported
N=${PYCKPT_TEST_PROCESSES:-2}
if [ "$N" = 0 ]; then
    pytest -p no:cacheprovider "$@" 2>&1 | tee "$VENV/compat.log"
else
    pytest -p no:cacheprovider -n "$N" --dist loadfile "$@" 2>&1 | tee "$VENV/compat.log"
fi
exit "${PIPESTATUS[0]}"
