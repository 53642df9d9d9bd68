#!/bin/bash
# What scripts/gpu_load_check.py needs on a CUDA machine that has torch but no DeepSpeed and no package
# index: DeepSpeed 0.19.8 copied from this venv (with its metadata, which transformers asks for), the
# wheels of its missing dependencies, and two small ZeRO checkpoints (ZeRO-2 and ZeRO-3, bf16, saved at
# 2 CPU ranks) with ds_to_universal's conversion beside each. Run from the repository root, here:
#     bash scripts/gpu_bundle.sh
# then on the device machine (.gpu and .whl carried; both are in .git/info/exclude):
#     python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site . &&
#     python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl &&
#     PYTHONPATH=/tmp/site:$PWD/.gpu python3 scripts/gpu_load_check.py
set -euo pipefail
. .venv/bin/activate
# DeepSpeed prints its accelerator warning on stdout when it has to guess; the guess is the CPU here
export DS_ACCELERATOR=cpu
site=$(python -c "import deepspeed, os; print(os.path.dirname(os.path.dirname(deepspeed.__file__)))")
rm -rf .gpu .whl && mkdir -p .gpu .whl
cp -r "$site/deepspeed" "$site"/deepspeed-*.dist-info .gpu/
find .gpu/deepspeed -name __pycache__ -prune -exec rm -rf {} +
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    "pydantic==$(pip show pydantic | awk '/^Version/{print $2}')" \
    "pydantic_core==$(pip show pydantic_core | awk '/^Version/{print $2}')" annotated_types typing_inspection hjson
for stage in 2 3; do
    torchrun --standalone --nproc_per_node 2 benchmarks/make_real_checkpoint.py .gpu/z$stage --params 400K \
        --width 128 --stage $stage --dtype bf16 > /dev/null
    python "$site/deepspeed/checkpoint/ds_to_universal.py" --input_folder .gpu/z$stage/global_step1 \
        --output_folder .gpu/z$stage/global_step1_universal > /dev/null
done
mkdir -p .git/info
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
du -sh .gpu .whl
