"""Broken and hostile input: one clear error naming the file, nothing run, no complete-looking output."""

import os

import numpy as np
import pytest
import torch

import pyckpt
from pyckpt import CheckpointFormatError, UnsafePickleError
from pyckpt import _core

from edit import copy_checkpoint


class _RunsCode:

    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd, ))


@pytest.fixture
def ckpt_copy(tmp_path, checkpoints):
    """A private copy of a real ZeRO-2 dp=2 checkpoint that a test may damage."""
    root, tag = copy_checkpoint(checkpoints["s2_bf16_dp2"].tag_dir, tmp_path)
    return root, tag.name


def _optim(root, tag, rank):
    folder = root / tag
    (name, ) = [n for n in os.listdir(folder) if f"zero_pp_rank_{rank}_" in n and n.endswith("optim_states.pt")]
    return folder / name


def _assert_no_output(out):
    parent = out.parent
    assert not out.exists()
    assert not (parent / "latest_universal").exists()
    assert not [n for n in os.listdir(parent) if "pyckpt-tmp" in n], os.listdir(parent)


def test_malicious_shard_is_refused_and_nothing_runs(ckpt_copy, tmp_path):
    root, tag = ckpt_copy
    marker = tmp_path / "pwned"
    victim = _optim(root, tag, 1)
    torch.save({"optimizer_state_dict": _RunsCode(f"touch {marker}")}, victim)
    out = tmp_path / "out" / "u"
    out.parent.mkdir()
    with pytest.raises(UnsafePickleError, match=str(victim)):
        pyckpt.convert_to_universal(root, out)
    assert not marker.exists()
    _assert_no_output(out)


def test_truncated_shard_names_the_file(ckpt_copy, tmp_path):
    root, tag = ckpt_copy
    victim = _optim(root, tag, 1)
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    out = tmp_path / "out" / "u"
    out.parent.mkdir()
    with pytest.raises(CheckpointFormatError, match=str(victim)):
        pyckpt.convert_to_universal(root, out)
    _assert_no_output(out)


def test_missing_dp_rank_names_the_rank(ckpt_copy, tmp_path):
    root, tag = ckpt_copy
    os.remove(_optim(root, tag, 0))
    out = tmp_path / "out" / "u"
    out.parent.mkdir()
    with pytest.raises(CheckpointFormatError, match=r"dp rank\(s\) \[0\].*zero_pp_rank_0_mp_rank_00"):
        pyckpt.convert_to_universal(root, out)
    _assert_no_output(out)


def test_a_huge_rank_in_a_file_name_costs_no_huge_list(ckpt_copy, tmp_path):
    # Found by test_fuzz: a shard renamed to rank 10**11 made the missing-rank report a list of
    # 10**11 numbers (MemoryError). Now: the first few missing ranks and their count.
    root, tag = ckpt_copy
    victim = _optim(root, tag, 1)
    os.rename(victim, str(victim).replace("zero_pp_rank_1_", "zero_pp_rank_100000000000_"))
    out = tmp_path / "out" / "u"
    out.parent.mkdir()
    with pytest.raises(CheckpointFormatError, match=r"dp rank\(s\) \[1, 2, 3, 4, 5\] and 99999999994 more"):
        pyckpt.convert_to_universal(root, out)
    _assert_no_output(out)


def test_missing_last_dp_rank_is_caught_by_partition_count(ckpt_copy, tmp_path):
    # Removing the highest rank leaves a gap-free set 0..dp-2, which only partition_count exposes.
    root, tag = ckpt_copy
    os.remove(_optim(root, tag, 1))
    out = tmp_path / "out" / "u"
    out.parent.mkdir()
    with pytest.raises(CheckpointFormatError, match=r"partition_count \[2\]"):
        pyckpt.convert_to_universal(root, out)


def test_corrupt_zip_directory_names_the_file(ckpt_copy, tmp_path):
    root, tag = ckpt_copy
    victim = _optim(root, tag, 0)
    data = bytearray(victim.read_bytes())
    central = data.find(b"PK\x01\x02")
    data[central:central + 46] = b"\xa5" * 46  # the first central-directory entry is garbage
    victim.write_bytes(bytes(data))
    out = tmp_path / "out" / "u"
    out.parent.mkdir()
    with pytest.raises(CheckpointFormatError, match=str(victim)):
        pyckpt.convert_to_universal(root, out)
    _assert_no_output(out)


def test_disagreeing_end_records_name_the_file(ckpt_copy, tmp_path):
    # torch writes the plain and the ZIP64 end record; a reader that trusted only one would miss this.
    root, tag = ckpt_copy
    victim = _optim(root, tag, 0)
    data = bytearray(victim.read_bytes())
    eocd = data.rfind(b"PK\x05\x06")
    data[eocd + 16:eocd + 20] = (len(data) + 1000).to_bytes(4, "little")
    victim.write_bytes(bytes(data))
    out = tmp_path / "out" / "u"
    out.parent.mkdir()
    with pytest.raises(CheckpointFormatError, match=f"{victim}.*disagree"):
        pyckpt.convert_to_universal(root, out)
    _assert_no_output(out)


def test_failure_while_writing_leaves_nothing(ckpt_copy, tmp_path, monkeypatch):
    root, tag = ckpt_copy
    real = _core.write_archives

    def failing(sources, outputs, ops, *args, **kwargs):
        ops = np.asarray(ops)
        real(sources, outputs[:3], ops[ops[:, 2] < 3], *args, **kwargs)  # some files really get written first
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(_core, "write_archives", failing)
    out = tmp_path / "out" / "u"
    out.parent.mkdir()
    with pytest.raises(OSError, match="simulated"):
        pyckpt.convert_to_universal(root, out)
    _assert_no_output(out)


def test_existing_output_is_kept_unless_overwrite(ckpt_copy, tmp_path):
    root, tag = ckpt_copy
    out = tmp_path / "out" / "u"
    out.mkdir(parents=True)
    (out / "keep").write_text("x")
    with pytest.raises(pyckpt.OutputExistsError):
        pyckpt.convert_to_universal(root, out)
    assert (out / "keep").exists()
    pyckpt.convert_to_universal(root, out, overwrite=True)
    assert not (out / "keep").exists() and (out / "zero" / "optimizer_state.pt").exists()
    assert (out.parent / "latest_universal").read_text() == "u"
