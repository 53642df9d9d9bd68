"""The command lines: python -m pyckpt.convert (ds_to_universal.py flags too) and pyckpt inspect (python -m pyckpt.describe)."""

import json
import subprocess
import sys
import tempfile

import dsharness
from compare import diff_folders


def run(*args, check=True, cwd=None):
    # From a neutral folder: in the repository root, the source `pyckpt/` (no native module) would
    # shadow the installed package.
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd or tempfile.gettempdir())
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed with {proc.returncode}:\n{proc.stderr}")
    return proc


def test_convert_positional_matches_deepspeed(checkpoints, deepspeed_universal, tmp_path):
    ck = checkpoints["s1_fp32_dp2"]
    out = tmp_path / "u"
    proc = run("-m", "pyckpt.convert", str(ck.tag_dir), str(out), "--workers", "2", "--json")
    report = json.loads(proc.stdout)
    assert report["stage"] == 1 and report["dp"] == 2 and report["params"] > 0 and report["bytes_written"] > 0
    assert "converted" in proc.stderr and "GB/s" in proc.stderr  # the closing line
    assert diff_folders(str(deepspeed_universal["s1_fp32_dp2"]), str(out)) == []


def test_convert_accepts_ds_to_universal_flags(checkpoints, deepspeed_universal, tmp_path):
    ck = checkpoints["s2_fp32_dp2_no_uc_info"]
    out = tmp_path / "u"
    run("-m", "pyckpt.convert", "--input_folder", str(ck.tag_dir), "--output_folder", str(out),
        "--num_extract_workers", "4", "--num_merge_workers", "2", "--inject_missing_state", "--no_strict",
        "--keep_temp_folder", "--quiet")
    assert diff_folders(str(deepspeed_universal["s2_fp32_dp2_no_uc_info"]), str(out)) == []
    assert (tmp_path / "latest_universal").read_text() == "u"


def test_missing_universal_checkpoint_info_is_one_line_error(checkpoints, tmp_path):
    ck = checkpoints["s2_fp32_dp2_no_uc_info"]
    proc = run("-m", "pyckpt.convert", str(ck.tag_dir), str(tmp_path / "u"), check=False)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "universal_checkpoint_info" in proc.stderr
    assert "--inject_missing_state" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "u").exists()


def test_an_output_name_latest_universal_cannot_name_back_is_refused_before_work(checkpoints, tmp_path):
    # DeepSpeed strips what it reads from latest_universal: it would look for another folder
    ck = checkpoints["s1_fp32_dp2"]
    for name in ("u ", " u", "u\n", "u\x1b[2J"):
        proc = run("-m", "pyckpt.convert", str(ck.tag_dir), str(tmp_path / name), check=False)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"pyckpt: error: {tmp_path}: the output folder name {name!r} ")
        assert "latest_universal" in proc.stderr and "Traceback" not in proc.stderr
        assert list(tmp_path.iterdir()) == []


def test_dry_run_writes_nothing(checkpoints, tmp_path):
    ck = checkpoints["s3_fp32_dp2_subgroups"]
    proc = run("-m", "pyckpt.convert", str(ck.root), str(tmp_path / "u"), "--dry-run")
    assert "zero/optimizer_state.pt" in proc.stdout and "archive(s)" in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_help_explains_usage():
    out = run("-m", "pyckpt.convert", "--help").stdout
    for word in ("INPUT", "OUTPUT", "load_universal", "--workers", "--dry-run", "--inject_missing_state",
                 "--input_folder", "--overwrite"):
        assert word in out, word


def test_usage_error_exits_2():
    assert run("-m", "pyckpt.convert", check=False).returncode == 2


def test_inspect_reports_topology(checkpoints):
    ck = checkpoints["s3_bf16_dp3"]
    info = json.loads(run("-m", "pyckpt.describe", str(ck.root), "--json").stdout)
    assert info["zero_stage"] == 3 and info["dp"] == 3
    assert info["master_dtype"] == "float32" and info["bf16_optimizer_files"] is True
    assert info["trainable_numel"] > 0 and info["bytes"] > 0 and info["files"] >= 6
    text = run("-m", "pyckpt.describe", str(ck.tag_dir)).stdout
    assert "zero_stage: 3" in text and "dp: 3" in text


def test_inspect_reports_dtypes(checkpoints):
    info = json.loads(run("-m", "pyckpt.describe", str(checkpoints["s2_bf16_dp2"].tag_dir), "--json").stdout)
    assert list(info["model_dtypes"]) == ["bfloat16"] and info["master_dtype"] == "float32"
    assert info["zero_stage"] == 2 and info["dp"] == 2 and info["frozen_params"] == 0


def test_inspect_says_at_which_topologies_a_checkpoint_resumes(checkpoints):
    """The topologies its metadata allows a resume at: any data-parallel size; ZeRO-1/2 alike or
    ZeRO-3; other tensor-parallel sizes only where AutoTP's merge rules are recorded; AutoEP sizes
    that divide every layer's experts (DeepSpeed's rule), the data-parallel size a multiple of it."""
    def info(name):
        return json.loads(run("-m", "pyckpt.describe", str(checkpoints[name].root), "--json").stdout)

    dense = info("s2_bf16_dp2")
    assert dense["resumable"] == {"zero_stages": [1, 2], "data_parallel": "any", "tensor_parallel": [1],
                                  "expert_parallel": None}
    assert dense["resumable_at"] == ("ZeRO-1 or 2; any data-parallel size; tensor-parallel 1 only (no "
                                     "tensor-parallel merge rules recorded)")
    assert info("s3_bf16_dp3")["resumable"]["zero_stages"] == [3]
    autotp = info("tp_s2_bf16")["resumable"]
    assert autotp["tensor_parallel"] == "any" and autotp["expert_parallel"] is None
    moe = info("ep_s2_bf16")
    n = dsharness.MOE_NUM_EXPERTS
    assert moe["resumable"]["expert_parallel"] == [e for e in range(1, n + 1) if n % e == 0]
    assert moe["resumable_at"].endswith("; expert-parallel " + ", ".join(str(e) for e in range(1, n + 1) if n % e == 0))
    assert "any data-parallel size that the expert-parallel size divides" in moe["resumable_at"]
    text = run("-m", "pyckpt.describe", str(checkpoints["s2_bf16_dp2"].tag_dir)).stdout
    assert "\nresumable at: ZeRO-1 or 2; any data-parallel size;" in text and "resumable:" not in text


def test_inspect_error_is_one_line(tmp_path):
    proc = run("-m", "pyckpt.describe", str(tmp_path), check=False)
    assert proc.returncode == 1 and "not a DeepSpeed ZeRO checkpoint" in proc.stderr
