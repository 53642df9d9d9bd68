#!/bin/bash
# Every GPU check of the project in one bounded run, for a CUDA machine that has torch but no
# DeepSpeed and no package index. Prepare on a machine with the project's .venv with
# `bash scripts/gpu_bundle.sh`, copy the checkout with .gpu and .whl over, then from its root:
#     bash scripts/gpu_run.sh [bench-rounds]
# In order of importance, each step bounded so that a hang in one leaves time for the rest:
#   1. build pyckpt there, install DeepSpeed's missing dependencies;
#   2. scripts/gpu_save_check.py: the asynchronous save on the GPU, every ZeRO layout, bit for bit;
#   3. the unit test files with CUDA cases (none may be skipped there);
#   4. benchmarks/save.py --async-rounds at 201M, bf16 ZeRO-2, one GPU rank (issue 26's figures);
#   5. scripts/gpu_load_check.py: the load backend into GPU partitions, bit for bit;
#   6. the same benchmark under ZeRO-3, if time is left.
# Logs and the benchmarks' JSON go to $OUT (default /tmp/pyckpt_gpu_out); the last lines of each step print.
set -u
OUT=${OUT:-/tmp/pyckpt_gpu_out}
mkdir -p "$OUT"
ROUNDS=${1:-3}
ACCEL=${PYCKPT_GPU_ACCEL:-cuda}  # cpu: a dry run of this script on a machine without one
PARAMS=${PYCKPT_GPU_BENCH_PARAMS:-200M}
REPO=$PWD
DEADLINE=$((SECONDS + ${PYCKPT_GPU_BUDGET_S:-520}))
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/pyckpt_ext
left() { echo $((DEADLINE - SECONDS)); }
step() {  # step NAME MAX_SECONDS LOG COMMAND...: runs it bounded by MAX_SECONDS and the time left
    local name=$1 max=$2 log=$3; shift 3
    local t=$(left); [ "$t" -gt "$max" ] && t=$max
    if [ "$t" -lt 20 ]; then echo "== $name: skipped, ${t} s left"; return; fi
    local t0=$SECONDS
    timeout -k 5 "$t" "$@" > "$OUT/$log" 2>&1
    local rc=$?
    echo "== $name: rc $rc in $((SECONDS - t0)) s (limit $t s)"
    grep -E "$PATTERN" "$OUT/$log" | tail -n 40
    [ $rc -ne 0 ] && tail -n 25 "$OUT/$log"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; python3 -c \
  "import torch; print('torch', torch.__version__, torch.cuda.is_available())"; df -h /tmp | tail -1; } 2>&1
PATTERN="error|Error|ERROR"
step build 240 build.log bash -c "python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site $REPO && \
    python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site $REPO/.whl/*.whl"
export PYTHONPATH=/tmp/site:$REPO/.gpu
(cd /tmp && python3 -c "import pyckpt, deepspeed; print('pyckpt', pyckpt.__file__, 'deepspeed', deepspeed.__version__)" 2>&1 | tail -1)

PATTERN="^(z[0-9]|bf16|device|[0-9]+ of)"
step save-check 200 save_check.log python3 scripts/gpu_save_check.py

PATTERN="passed|failed|SKIPPED|FAILED|Error"
cd /tmp
step unit-tests 150 unit_tests.log python3 -m pytest -q -p no:cacheprovider -n 8 -m "not slow" -rs \
    "$REPO/tests/deepspeed/save/test_async_units.py" "$REPO/tests/deepspeed/save/test_slot_save.py" \
    "$REPO/tests/deepspeed/load/test_gather_staging.py"
cd "$REPO"

PATTERN="^(async round|snapshot copies|\{)"
step bench-z2 240 bench_z2.log env DS_ACCELERATOR=$ACCEL python3 -m torch.distributed.run --standalone --nproc_per_node 1 \
    benchmarks/save.py /tmp/pyckpt_bench --params $PARAMS --stage 2 --dtype bf16 --rounds 0 --async-rounds "$ROUNDS" \
    --json "$OUT/async_save_z2_bf16_200M_gpu.json"

PATTERN="^(ZeRO|device)"
step load-check 120 load_check.log python3 scripts/gpu_load_check.py

PATTERN="^(async round|snapshot copies|\{)"
step bench-z3 200 bench_z3.log env DS_ACCELERATOR=$ACCEL python3 -m torch.distributed.run --standalone --nproc_per_node 1 \
    benchmarks/save.py /tmp/pyckpt_bench --params $PARAMS --stage 3 --dtype bf16 --rounds 0 --async-rounds "$ROUNDS" \
    --json "$OUT/async_save_z3_bf16_200M_gpu.json"
echo "== all steps done, $(left) s of the budget left"
