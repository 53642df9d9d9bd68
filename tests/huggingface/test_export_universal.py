"""Exporting a Universal Checkpoint gives the files exporting its ZeRO checkpoint gives.

A universal folder (pyckpt's converter output or DeepSpeed's ds_to_universal.py's) keeps every
trainable parameter's fp32 master in ``zero/<name>/fp32.pt`` and a copy of the model-state files,
which hold the buffers, frozen parameters and tied aliases: the same zero_to_fp32 state dict.
The outputs are compared as files, byte for byte. The reader's refusals of damaged folders are
one-line CheckpointFormatErrors naming the file, with nothing written.
"""

import json
import os
import shutil

import pytest
import torch

from edit import rewrite
from pyckpt.errors import CheckpointFormatError, UnsafePickleError
from pyckpt.huggingface.export import export_hf


def _files(folder):
    return {f: (folder / f).read_bytes() for f in sorted(os.listdir(folder))}


# (config, export dtype): every stage, bf16 masters, BF16_Optimizer, frozen + tied, ZeRO-3 sub-groups,
# AutoTP at ZeRO-1/2/3 (merged TP slices), AutoEP at ZeRO-1/2/3 (full [E, ...] experts); with casts.
PARITY = [("s1_fp32_dp2", "fp32"), ("s2_bf16_dp2", "bf16"), ("s3_fp32_dp2_subgroups", "fp32"), ("s3_bf16_dp3", "fp16"),
          ("s1_bf16_dp2_bf16_optimizer", "fp32"), ("s1_frozen_tied", "fp32"), ("s2_bf16_frozen_tied", "bf16"),
          ("s3_frozen_tied", "fp32"), ("tp_s2_bf16", "fp32"), ("tp_s3_bf16_kv2", "bf16"), ("ep_s2_bf16", "fp32"),
          ("ep_s3_fp32", "bf16")]


@pytest.mark.parametrize("name,dtype", PARITY, ids=[f"{n}-{d}" for n, d in PARITY])
def test_universal_exports_the_zero_checkpoints_files(checkpoints, pyckpt_universal, deepspeed_universal, tmp_path,
                                                      name, dtype):
    ck = checkpoints[name]
    export_hf(ck.root, tmp_path / "zero", dtype=dtype)
    want = _files(tmp_path / "zero")
    assert list(want) == ["model.safetensors"]
    # each input as a user may name it: the tag folder, or the folder holding latest_universal
    for i, source in enumerate((pyckpt_universal[name], deepspeed_universal[name])):
        for form, folder in (("tag", source), ("pointer", source.parent)):
            out = tmp_path / f"{i}-{form}"
            report = export_hf(folder, out, dtype=dtype)
            assert report.input == str(source)
            assert _files(out) == want, (source, form)


@pytest.mark.parametrize("name", ["s3_frozen_tied", "s2_bf16_frozen_tied", "tp_s1_fp32", "ep_s1_fp32"])
def test_universal_torch_bin_and_shards_equal_the_zero_checkpoints(checkpoints, pyckpt_universal, deepspeed_universal,
                                                                   tmp_path, name):
    """torch.save output keeps aliases shared and records requires_grad: those must match too."""
    ck = checkpoints[name]
    for kind, kwargs in (("bin", {"torch_bin": True}), ("shards", {"max_shard_size": "400"}),
                         ("trainable", {"exclude_frozen_parameters": True})):
        export_hf(ck.root, tmp_path / f"zero-{kind}", **kwargs)
        want = _files(tmp_path / f"zero-{kind}")
        assert kind != "shards" or len(want) > 2  # really split, with an index
        for i, source in enumerate((pyckpt_universal[name], deepspeed_universal[name])):
            out = tmp_path / f"{i}-{kind}"
            export_hf(source.parent, out, tag=source.name, **kwargs)  # -t names the universal tag folder
            assert _files(out) == want, (source, kind)


def test_lazy_state_dict_of_a_universal_folder_is_the_zero_checkpoints(checkpoints, deepspeed_universal):
    import pyckpt
    name = "s2_bf16_frozen_tied"
    zero, universal = pyckpt.state_dict(checkpoints[name].root), pyckpt.state_dict(deepspeed_universal[name])
    assert list(universal) == list(zero)
    assert all(torch.equal(universal[k], zero[k]) and universal[k].dtype == zero[k].dtype for k in zero)


def test_companions_are_looked_for_beside_the_universal_folder(pyckpt_universal, tmp_path):
    root = tmp_path / "run"
    source = pyckpt_universal["s2_bf16_dp2"]
    shutil.copytree(source.parent, root, ignore=shutil.ignore_patterns(".*"))
    config = {"model_type": "tiny", "torch_dtype": "bfloat16"}
    (root / "config.json").write_text(json.dumps(config))
    (root / "tokenizer.json").write_text("{}")
    report = export_hf(root, tmp_path / "hf", dtype="auto")
    assert report.dtype == "bfloat16"
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == config


def test_a_save_folder_with_latest_and_latest_universal_is_read_through_latest(checkpoints, deepspeed_universal,
                                                                               tmp_path):
    root = tmp_path / "ckpt"  # where ds_to_universal --output_folder ckpt/<tag>_universal puts both pointers
    shutil.copytree(checkpoints["s1_fp32_dp2"].root, root)
    source = deepspeed_universal["s1_fp32_dp2"]
    shutil.copytree(source, root / source.name)
    (root / "latest_universal").write_text(source.name)
    report = export_hf(root, tmp_path / "a")
    assert report.input == str(root / checkpoints["s1_fp32_dp2"].tag)
    again = export_hf(root / source.name, tmp_path / "b")
    assert again.input == str(root / source.name)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


def test_command_line_takes_a_universal_folder(checkpoints, deepspeed_universal, tmp_path):
    import subprocess
    import sys
    import tempfile

    def run(*args):  # outside the source folder, whose pyckpt/ has no native module
        return subprocess.run([sys.executable, "-m", "pyckpt.export", *map(str, args)], capture_output=True,
                              text=True, timeout=300, cwd=tempfile.gettempdir())

    source = deepspeed_universal["s3_bf16_dp3"]
    dry = run(source.parent, tmp_path / "dry", "--dry-run")
    assert dry.returncode == 0 and "model.safetensors" in dry.stdout and not (tmp_path / "dry").exists(), dry.stderr
    proc = run(source.parent, tmp_path / "hf", "--dtype", "bf16", "--json", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["input"] == str(source)
    export_hf(checkpoints["s3_bf16_dp3"].root, tmp_path / "zero", dtype="bf16")
    assert _files(tmp_path / "hf") == _files(tmp_path / "zero")


# -- damaged and hostile universal folders ------------------------------------------------------

def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _rename_in_param_shapes(new_name):
    def edit(obj):
        group = obj["param_shapes"][0]
        old = next(iter(group))
        items = [(new_name if k == old else k, v) for k, v in group.items()]
        group.clear()
        group.update(items)
    return edit


# (what is damaged, the file the error names, a word of the rule) on a copy of DeepSpeed's universal
# output of s2_bf16_frozen_tied (ZeRO-2: dict fp32.pt) or s3_fp32_dp4 (ZeRO-3: raw flat fp32.pt).
DAMAGE = {
    "truncated fp32.pt": ("s2_bf16_frozen_tied", "zero/emb.weight/fp32.pt",
                          lambda u: _truncate(u / "zero/emb.weight/fp32.pt"), "emb.weight/fp32.pt"),
    "missing fp32.pt": ("s2_bf16_frozen_tied", "zero/emb.weight/fp32.pt",
                        lambda u: os.remove(u / "zero/emb.weight/fp32.pt"), "missing"),
    "missing parameter folder": ("s3_fp32_dp4", "zero/l0.weight/fp32.pt",
                                 lambda u: shutil.rmtree(u / "zero/l0.weight"), "missing"),
    "'..' in a parameter name": ("s2_bf16_frozen_tied", "mp_rank_00_model_states.pt",
                                 lambda u: rewrite(str(u / "mp_rank_00_model_states.pt"),
                                                   _rename_in_param_shapes("..")), "not a DeepSpeed parameter name"),
    "'a..b' parameter name": ("s3_fp32_dp4", "zero_pp_rank_0_mp_rank_00_model_states.pt",
                              lambda u: rewrite(str(u / "zero_pp_rank_0_mp_rank_00_model_states.pt"),
                                                _rename_in_param_shapes("l0..weight")), "empty '.'-separated part"),
    "fp32 shape not param_shapes'": ("s2_bf16_frozen_tied", "zero/emb.weight/fp32.pt",
                                     lambda u: torch.save({"param": torch.zeros(13, 4)}, u / "zero/emb.weight/fp32.pt"),
                                     "does not agree with param_shapes"),
    "same numel, other shape": ("s2_bf16_frozen_tied", "zero/emb.weight/fp32.pt",
                                lambda u: torch.save({"param": torch.zeros(65)}, u / "zero/emb.weight/fp32.pt"),
                                "does not agree with param_shapes"),
    "flat fp32 of another size": ("s3_fp32_dp4", "zero/l0.weight/fp32.pt",
                                  lambda u: torch.save(torch.zeros(3), u / "zero/l0.weight/fp32.pt"),
                                  "does not agree with param_shapes"),
    "bf16 master": ("s2_bf16_frozen_tied", "zero/emb.weight/fp32.pt",
                    lambda u: torch.save({"param": torch.zeros(13, 5, dtype=torch.bfloat16)},
                                         u / "zero/emb.weight/fp32.pt"), "float32"),
    "raw tensor at ZeRO-2": ("s2_bf16_frozen_tied", "zero/emb.weight/fp32.pt",
                             lambda u: torch.save(torch.zeros(13, 5), u / "zero/emb.weight/fp32.pt"),
                             "holds a tensor; load_universal expects a dict with a 'param' tensor"),
    "code in fp32.pt": ("s2_bf16_frozen_tied", "zero/emb.weight/fp32.pt",
                        lambda u: torch.save({"param": torch.zeros(13, 5), "x": shutil.rmtree},
                                             u / "zero/emb.weight/fp32.pt"), "refusing to load global 'shutil.rmtree'"),
    "missing dp rank's model states": ("s3_fp32_dp4", "zero_pp_rank_3_mp_rank_00_model_states.pt",
                                       lambda u: os.remove(u / "zero_pp_rank_3_mp_rank_00_model_states.pt"),
                                       "missing: zero_pp_rank_0_mp_rank_00_model_states.pt says dp_world_size is 4"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_universal_folders_are_refused_naming_the_file(deepspeed_universal, tmp_path, case):
    name, culprit, damage, rule = DAMAGE[case]
    source = deepspeed_universal[name]
    folder = tmp_path / "ckpt" / source.name
    shutil.copytree(source, folder)
    damage(folder)
    out = tmp_path / "hf"
    # a pickle asking for code is an UnsafePickleError, the others break a format rule
    with pytest.raises(UnsafePickleError if case == "code in fp32.pt" else CheckpointFormatError) as ei:
        export_hf(folder, out)
    message = str(ei.value)
    assert message.startswith(str(folder / culprit)) and rule in message and "\n" not in message, message
    assert not out.exists() and os.listdir(tmp_path) == ["ckpt"]  # nothing written, no staging left


def test_pointer_and_layout_refusals(tmp_path):
    """Checks that need no checkpoint: a pointer leaving its folder, a universal folder without model states."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "latest_universal").write_text("../elsewhere")
    with pytest.raises(CheckpointFormatError, match="latest_universal: names tag '../elsewhere', which is not a folder"):
        export_hf(tmp_path / "a", tmp_path / "out")
    (tmp_path / "a" / "latest_universal").write_text("gone_universal")
    with pytest.raises(CheckpointFormatError, match="names tag 'gone_universal', but .* does not exist"):
        export_hf(tmp_path / "a", tmp_path / "out")
    (tmp_path / "b" / "zero").mkdir(parents=True)
    with pytest.raises(CheckpointFormatError, match=r"no \*_model_states.pt file"):
        export_hf(tmp_path / "b", tmp_path / "out")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "zero").write_text("")
    (tmp_path / "c" / "mp_rank_00_model_states.pt").write_text("")
    with pytest.raises(CheckpointFormatError, match="zero: not a folder"):
        export_hf(tmp_path / "c", tmp_path / "out")
    assert not (tmp_path / "out").exists()
