"""Smoke test of the benchmark driver: `benchmarks/run.py --quick` runs end to end and reports.

Only that it runs and reports is checked; times on a shared CI runner say nothing about speed.
"""

import json
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def test_run_quick(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--work", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| pyckpt |" in proc.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    assert set(result["tools"]) == {"pyckpt", "ds_to_universal", "zero_to_fp32", "cp -r"}
    for name, t in result["tools"].items():
        assert t["median_s"] > 0, name
        assert t["peak_rss_mib"] > 0, name
    assert result["checked_bit_equal"]
    assert result["tools"]["pyckpt"]["temp_gib"] == 0
    # --quick deletes the checkpoint it made; only the result stays behind.
    assert not list(tmp_path.glob("syn_*"))


def test_run_quick_export(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--export", "--work",
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model.safetensors is byte-identical to zero_to_fp32's" in proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["job"] == "export" and result["checked_bit_equal"]
    assert set(result["tools"]) == {"pyckpt export", "zero_to_fp32 --safe", "cp output"}
    assert set(result["ratios"]) == {"zero_to_fp32 --safe / pyckpt export", "pyckpt export / cp output"}
    assert all(t["median_s"] > 0 and t["peak_rss_mib"] >= 0 for t in result["tools"].values())
