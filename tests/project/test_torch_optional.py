"""Converting, inspecting and verifying need no torch: pyckpt reads and writes torch's format itself.

torch is an optional dependency (``pip install pyckpt[torch]``) for the parts that hand tensors to
a caller. These tests run the command lines in a fresh interpreter where ``import torch`` (and
``import deepspeed``) fails, on checkpoints from the generator (which needs no torch either): a
stray import anywhere on those paths fails them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "make_checkpoint.py"

# None in sys.modules makes `import torch` raise ImportError, as on a machine without it.
NO_TORCH = ("import runpy, sys\n"
            "for name in ('torch', 'deepspeed'):\n"
            "    sys.modules[name] = None\n"
            "sys.argv = sys.argv[1:]\n"
            "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n")


def _without_torch(tmp_path, module, *args):
    return subprocess.run([sys.executable, "-c", NO_TORCH, module, *map(str, args)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)


@pytest.mark.parametrize("kw", [["--stage", "2", "--dtype", "bf16", "--experts", "4", "--ep", "2", "--moe-layers", "1"],
                                ["--stage", "3", "--tp", "2"]], ids=["zero2_autoep", "zero3_tp2"])
def test_convert_inspect_verify_without_torch(tmp_path, kw):
    ckpt = tmp_path / "ckpt"
    made = subprocess.run([sys.executable, "-c", NO_TORCH.replace("runpy.run_module(sys.argv[0], run_name='__main__', "
                                                                  "alter_sys=True)",
                                                                  "runpy.run_path(sys.argv[0], run_name='__main__')"),
                           str(SCRIPT), str(ckpt), "--params", "20k", "--dp", "2", *kw],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    out = tmp_path / "universal"
    conv = _without_torch(tmp_path, "pyckpt.convert", ckpt, out, "--quiet")
    assert conv.returncode == 0, conv.stderr
    assert (tmp_path / "latest_universal").read_text() == "universal"
    assert os.path.isdir(out / "zero")
    info = _without_torch(tmp_path, "pyckpt.describe", ckpt, "--json")
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["dp"] == 2
    check = _without_torch(tmp_path, "pyckpt.verify", out, "--against", ckpt, "--quiet")
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_guard_really_blocks_torch(tmp_path):
    """The harness above must make torch unimportable, or the test would pass on any code."""
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\n")
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, "probe"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode != 0 and "import of torch halted" in proc.stderr
