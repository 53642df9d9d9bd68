"""Smoke test of the benchmark driver: `benchmarks/run.py --quick` runs end to end and reports.

Only that it runs and reports is checked; times on a shared CI runner say nothing about speed.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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


def test_scale_quick(tmp_path):
    # Two tiny points: that every measurement runs, reports, and ran under the NOFILE limit (as the
    # measured processes themselves read it), not how fast anything is.
    results = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--sweep", "ranks", "--dps", "4,8",
                           "--no-ds", "--runs", "1", "--work", str(tmp_path / "work"), "--results", str(results)],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((results / "scale_ranks.json").read_text())
    assert data["nofile"] == 1024 and [p["dp"] for p in data["points"]] == [4, 8]
    for p in data["points"]:
        assert p["input_files"] == p["dp"] + 1 and p["numel"] > 0
        m = p["measurements"]
        for name in ("convert_dry", "export_dry", "convert", "cp"):
            assert m[name]["status"] == "ok", (p["label"], name, m[name])
            # cp can end before the first psutil sample where /usr/bin/time is missing.
            assert m[name]["wall_s"] > 0 and m[name]["peak_rss_mib"] >= (0 if name == "cp" else 1), (p["label"], name)
            assert m[name]["nofile"][0] == 1024, (p["label"], name, m[name]["nofile"])
        assert m["convert"]["output_bytes"] > 0 and m["convert"]["output_files"] > 0
        assert p["ratios"]["convert / cp -r"] > 0
        for plan in ("load_plan", "resume_plan"):  # one rank of a job at the point's dp
            assert m[plan]["status"] == "ok" and m[plan]["plan_s"] > 0 and m[plan]["params"] >= 1, m[plan]
            assert m[plan]["rank"] == p["dp"] // 2 and m[plan]["nofile"][0] == 1024
    assert "| dp8 |" in (results / "scale_ranks.md").read_text()
    if importlib.util.find_spec("matplotlib"):
        assert (results / "scale_ranks.png").stat().st_size > 0
    # The scratch checkpoints and outputs are gone.
    assert not any((tmp_path / "work").iterdir())


@pytest.mark.slow
def test_memory_nodes_quick(tmp_path, ds_environ):
    # benchmarks/memory_nodes.py --quick (two torchrun agents as two nodes, a tiny model): node 1 lost,
    # both ways resume at half the size to the same weights; the replication is timed against cp -r;
    # nothing is left in /dev/shm.
    out, result = tmp_path / "out", tmp_path / "memory_nodes.json"
    before = set(os.listdir("/dev/shm"))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_nodes.py"), str(out), "--quick",
                           "--json", str(result)], check=False, capture_output=True, text=True, timeout=600,
                          env=ds_environ, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    data = json.loads(result.read_text())
    (row, ) = data["rounds"]
    assert row["same_weights"] and row["pyckpt"]["global_steps"] == row["deepspeed"]["global_steps"] == 2
    assert row["pyckpt"]["parts"]["recovery"] > 0 and set(data["goals"]) == {"deepspeed_over_pyckpt",
                                                                              "replication_over_cp"}
    assert len(data["replication_alone"]) == 5 and all(v > 0 for v in data["medians"].values())
    assert not [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("pyckpt-bench-nodes-")]


@pytest.mark.slow
def test_memory_tier_quick(tmp_path, ds_environ):
    # benchmarks/memory_tier.py --quick on 2 ranks (a tiny model): every part runs and reports, the
    # recovery from memory restores what DeepSpeed's own load does, and nothing is left behind.
    out, root, result = tmp_path / "out", tmp_path / "mem", tmp_path / "memory_tier.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(ROOT / "benchmarks" / "memory_tier.py"), str(out), "--quick", "--memory-root",
                           str(root), "--json", str(result)], check=False, capture_output=True, text=True, timeout=600,
                          env=ds_environ, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(result.read_text())
    assert data["world_size"] == 2 and data["rounds_count"] == 1
    assert set(data["goals"]) == {"step_with_save_over_plain", "stall_over_memcpy", "stock_over_memory_load"}
    assert all(v > 0 for v in data["medians"].values())
    (rec, ) = data["recovery"]
    assert rec["same_weights"] and rec["memory"]["log"] and not rec["stock"]["log"]
    assert data["reads"]["resident_after_eviction"] >= 0 and data["persistence"][0]["persisted_bytes"] > 0
    assert not out.exists() and not root.exists()


def test_restore_floor_quick(tmp_path):
    # benchmarks/restore_floor.py on 2 processes: it copies what a restore of this many parameters must write
    # (fp32 partition + weights into held memory, the two moments into new memory), reports every repeat's
    # slowest rank, and removes its source file.
    result = tmp_path / "floor.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "restore_floor.py"), "--params", "1000001",
                           "--nproc", "2", "--repeats", "2", "--shm", str(tmp_path), "--json", str(result)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(result.read_text())
    part = 500001 * 4  # the flat partition, padded to the world size
    assert (data["held_bytes_per_rank"], data["fresh_bytes_per_rank"]) == (part + 4 * 1000001, 2 * part)
    assert len(data["repeats"]) == 2 and all(t > 0 for t in data["repeats"])
    assert min(data["repeats"]) <= data["median"] <= max(data["repeats"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["floor.json"]
