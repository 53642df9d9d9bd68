"""The README's first command: the built-in example's whole life cycle (pyckpt/demo.py) runs and
every one of its checks passes (it exits 1 at the first that fails)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import dsharness as h

pytestmark = pytest.mark.slow


def test_the_demo_runs_the_whole_life_cycle_with_every_check_passing(tmp_path):
    # ZeRO-3 here; scripts/demo.sh runs the default ZeRO-2
    env = h.ds_env(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "pyckpt.demo", str(tmp_path / "work"), "--stage", "3"], env=env,
                          cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:]
    lines = proc.stdout.splitlines()
    for step in ("[1/5] train+save:", "[2/5] convert:", "[3/5] export:", "[4/5] transformers:", "[5/5] resume:",
                 "done:"):
        assert sum(line.startswith(step) for line in lines) == 1, (step, proc.stdout[-5000:])
