"""The device checks run on the CPU too, so they cannot rot between the sessions that have a GPU.

`scripts/gpu_save_check.py` takes the host path where CUDA is missing (the same asynchronous saves,
DeepSpeed's own bytes, the bit-equal resume); `benchmarks/save.py --async-rounds` reports every figure
the GPU run reports but the GPU-only ones. Only that they run and agree is checked, not how fast.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path: Path, **extra) -> dict:
    # the host path on any machine, a GPU one too (the script picks CUDA wherever torch sees it)
    return dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"),
                **extra)


def test_the_gpu_save_check_passes_on_the_host_path(tmp_path):
    layouts = ["z2-bf16", "z3-bf16-offload"]
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_save_check.py"), *layouts],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                          env=_env(tmp_path, PYCKPT_GPU_SAVE_PARAMS="300K", PYCKPT_GPU_SAVE_WIDTH="128",
                                   MASTER_PORT=str(_free_port()), TMPDIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in layouts:
        assert f"{name}: OK (ok True, done at return False, after steps False, state changed True" in proc.stdout
    assert "2 of 2 layouts OK" in proc.stdout


def test_the_async_save_benchmark_reports_its_figures(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(ROOT / "benchmarks" / "save.py"), str(tmp_path / "scratch"), "--params", "1M",
                           "--width", "256", "--dtype", "bf16", "--rounds", "0", "--async-rounds", "1",
                           "--overlap-steps", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path), env=_env(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dtype"] == "bf16" and result["device"] == "cpu" and result["world_size"] == 2
    assert result["params"] > 900_000  # counted before ZeRO partitions anything
    medians = result["async"]["medians"]
    for key in ("sync_over_async_stall", "async_stall_over_memcpy", "overlap_step_over_plain", "published_over_sync"):
        assert medians[key] > 0, key
    assert "alone_snapshot" not in medians  # a GPU-only figure
    assert not (tmp_path / "scratch").exists() or not any((tmp_path / "scratch").iterdir())
