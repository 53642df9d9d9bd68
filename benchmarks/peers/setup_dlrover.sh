#!/usr/bin/env bash
# Builds .venv-dlrover (repo root, gitignored): one environment that runs pyckpt's memory tier, DLRover's
# Flash Checkpoint and DeepSpeed's own save side by side (benchmarks/memory_vs_dlrover.py), without touching
# the project's .venv (DLRover pulls grpcio, kubernetes and protobuf 4.x, none of which pyckpt needs).
#
# Steps, and why each:
#  1. python -m venv .venv-dlrover.
#  2. torch and deepspeed at the project's pins (constraints.txt): torch==2.13.0 is the CPU wheel that lies on
#     these machines' disk; pip takes it for that exact pin and never downloads a CUDA build.
#  3. dlrover==0.6.1 with what its flash checkpoint and master import but its wheel does not declare outside the
#     k8s extra: grpcio, kubernetes, tornado, and protobuf 4.x (its generated *_pb2 modules predate protobuf 5).
#  4. pyckpt itself from this checkout (release build of the native module, ~3 min on 2 cores), so the
#     benchmark measures whatever pyckpt/ holds when this script is run again.
#  5. Nothing is patched inside dlrover; what benchmarks/memory_vs_dlrover.py does around it:
#     - `dlrover-run --standalone` crashes on torch 2.13 (its elastic agent builds on torch's launcher
#       internals, which changed), so the benchmark plays dlrover-run's part by hand: it starts DLRover's local
#       master as dlrover-run would (python -m dlrover.python.master.main --port P --node_num 1 --job_name J
#       --platform local; DLROVER_MASTER_ADDR=127.0.0.1:P), and a long-lived "agent" process that runs
#       AsyncCheckpointSaver.start_async_saving_ckpt() (the part of dlrover-run's agent that holds the shared
#       memory across worker restarts). Workers run under plain torchrun with `--role dlrover-trainer` (torchrun
#       exports it as ROLE_NAME; with any other role each worker's local rank 0 starts a saver of its own, which
#       dies with it, and a restart finds nothing) and a fixed `--rdzv-id` (DLRover names its shared memory and
#       sockets after TORCHELASTIC_RUN_ID, which --standalone draws anew on every launch).
#     - DeepSpeed 0.19.8's TorchCheckpointEngine calls torch.save(..., _use_new_zipfile_serialization=) and
#       torch.load(..., weights_only=), which DLRover's stand-ins (AsyncCheckpointAgent.save/load) do not
#       accept: two wrappers drop those keywords.
#     - DeepSpeed 0.19.8's load globs the tag folder for the model-state file and asserts it exists; DLRover
#       removes that folder after a memory save, so the restart creates an empty file of that name (the bytes
#       come from DLRover's memory) and names the tag: DLRover records no tag a memory-only job could find
#       (its tracer file is written by disk saves), so load_checkpoint(dir) as documented resumes nothing.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
[ -x .venv-dlrover/bin/python ] || "$PY" -m venv .venv-dlrover
. .venv-dlrover/bin/activate
export PIP_CONSTRAINT="$PWD/constraints.txt"
python -m pip install --quiet torch==2.13.0 deepspeed==0.19.8 numpy psutil
python -m pip install --quiet dlrover==0.6.1 grpcio kubernetes tornado 'protobuf>=4,<5' pynvml deprecated requests
# pyckpt: the release build (no native test hooks), as a plain pip install of the checkout
python -m pip install --quiet .
python - <<'PY'
import torch, deepspeed, dlrover, pyckpt, google.protobuf, grpc
assert torch.__version__.startswith("2.13.0") and "+cpu" in torch.__version__, torch.__version__
print("torch", torch.__version__, "deepspeed", deepspeed.__version__, "protobuf", google.protobuf.__version__,
      "grpc", grpc.__version__, "pyckpt", pyckpt.__file__)
PY
