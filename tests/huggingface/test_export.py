"""pyckpt's consolidated export against DeepSpeed's zero_to_fp32, on real checkpoints.

Where zero_to_fp32 reads the input (ZeRO-1/2/3 without TP/PP or AutoEP) the export must hold its
state dict exactly: the same keys in the same order (tied aliases left out of safetensors, as
save_pretrained leaves them), the same tensors bit for bit after the same dtype cast. Where it
cannot (AutoTP, AutoEP), the reference is pyckpt's own Universal conversion, which the suite
proves against ds_to_universal: every exported tensor equals its universal fp32 tensor.
"""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from pyckpt.huggingface.export import export_hf
from pyckpt.huggingface.shards import parse_size, split

TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _zero_to_fp32(tag_dir, dtype):
    """zero_to_fp32's state dict, cast to ``dtype`` as its converters cast (None: as its
    get_fp32_state_dict_from_zero_checkpoint returns it, frozen parameters in their own dtype)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, to_torch_tensor

    lazy = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name, lazy_mode=True)
    return to_torch_tensor(lazy, dtype=TORCH[dtype] if dtype else None)


def _load_export(out):
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    state, order = {}, []
    for f in files:
        with safe_open(str(out / f), "pt") as sf:
            assert sf.metadata() == {"format": "pt"}
        part = load_file(str(out / f))
        order += list(part)
        state.update(part)
    return state, files


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        nan = torch.isnan(a)
        if not torch.equal(nan, torch.isnan(b)):
            return False
        bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
        return torch.equal(a[~nan].view(bits), b[~nan].view(bits))
    return torch.equal(a, b)


PARITY = [("s1_fp32_dp2", "fp32"), ("s2_bf16_dp2", "fp32"), ("s2_bf16_dp2", "bf16"), ("s3_fp32_dp2_subgroups", "fp32"),
          ("s3_bf16_dp3", "fp16"), ("s2_fp32_dp4", "bf16"), ("s1_frozen_tied", "fp32"), ("s2_bf16_frozen_tied", "fp32"),
          ("s3_frozen_tied", "bf16"), ("s3_fp32_dp3_no_uc_info", "fp32")]


@pytest.mark.parametrize("name,dtype", PARITY, ids=[f"{n}-{d}" for n, d in PARITY])
def test_export_equals_zero_to_fp32(checkpoints, tmp_path, name, dtype):
    ck = checkpoints[name]
    out = tmp_path / "hf"
    report = export_hf(ck.root, out, dtype=dtype)
    ref = _zero_to_fp32(ck.tag_dir, dtype)
    got, files = _load_export(out)
    aliases = {k for k in ref if any(ref[k] is ref[j] for j in ref if j != k and list(ref).index(j) < list(ref).index(k))}
    assert files == ["model.safetensors"]
    with safe_open(str(out / "model.safetensors"), "pt") as sf:
        stored_keys = set(sf.keys())
    assert stored_keys == set(ref) - aliases
    assert report.tensors == len(stored_keys)
    bad = [k for k in stored_keys if not _same(got[k], ref[k].contiguous())]
    assert bad == []
    assert not os.path.exists(out.parent / "latest_universal")  # an export writes no pointer


@pytest.mark.parametrize("name", ["s2_fp32_dp4", "s3_fp32_dp4"])
def test_sharded_export_splits_as_huggingface_hub_does(checkpoints, tmp_path, name):
    ck = checkpoints[name]
    ref = _zero_to_fp32(ck.tag_dir, "fp32")
    sizes = {k: v.numel() * v.element_size() for k, v in ref.items()}
    limit = max(sizes.values()) * 2 + 1  # several shards, each of more than one tensor
    out = tmp_path / "hf"
    export_hf(ck.root, out, max_shard_size=limit)
    expected = split(list(ref), sizes, {}, limit, "model.safetensors")
    assert expected.sharded
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": sum(sizes.values())}, "weight_map": expected.weight_map()}
    got, files = _load_export(out)
    assert files == sorted(expected.files)
    for f, keys in expected.files.items():
        assert set(load_file(str(out / f))) == set(keys)
    assert all(_same(got[k], ref[k].contiguous()) for k in ref)


# zero_to_fp32 refuses TP (file count), AutoEP and BF16_Optimizer shards (no zero_stage key).
BEYOND = ["tp_s1_fp32", "tp_s2_bf16", "tp_s3_fp32", "ep_s1_fp32", "ep_s2_bf16", "ep_s3_fp32",
          "s1_bf16_dp2_bf16_optimizer"]


@pytest.mark.parametrize("name", BEYOND)
def test_export_of_tp_and_autoep_equals_the_universal_masters(checkpoints, pyckpt_universal, tmp_path, name):
    """zero_to_fp32 refuses these; pyckpt's universal fp32 tensors are the proven reference."""
    if name == "s1_bf16_dp2_bf16_optimizer":
        with pytest.raises(ValueError, match="is not a zero checkpoint"):
            _zero_to_fp32(checkpoints[name].tag_dir, "fp32")
    ck = checkpoints[name]
    out = tmp_path / "hf"
    export_hf(ck.root, out)
    got, _ = _load_export(out)
    zero = pyckpt_universal[name] / "zero"
    trainable = [p for p in os.listdir(zero) if os.path.isdir(zero / p)]
    checked = 0
    for p in trainable:
        if p not in got:
            continue  # the universal fallback also writes frozen/buffer/alias entries as fp32
        obj = torch.load(zero / p / "fp32.pt", weights_only=True)
        t = obj["param"] if isinstance(obj, dict) else obj
        assert _same(got[p].reshape(-1), t.reshape(-1).float()), p
        checked += 1
    assert checked >= len(trainable) // 2 and checked > 0


def test_parse_size_reads_decimal_units_like_huggingface_hub():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 5 * 10**8
    assert parse_size(" 1.5kb ") == 1500
    assert parse_size(1234) == 1234 and parse_size("1234") == 1234
    for bad in ("5GiB", "5 G", "", "-1GB", 0, "0", "GB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_split_puts_oversized_tensors_first_and_aliases_with_their_holder():
    keys = ["a", "big", "b", "c", "tied"]
    sizes = {"a": 4, "big": 100, "b": 4, "c": 4}
    s = split(keys, sizes, {"tied": "a"}, 10, "model.safetensors")
    assert s.files == {"model-00001-of-00003.safetensors": ["big"],
                       "model-00002-of-00003.safetensors": ["a", "b", "tied"],
                       "model-00003-of-00003.safetensors": ["c"]}
    assert s.total_size == 112
    one = split(["a", "tied"], {"a": 4}, {"tied": "a"}, 10, "model.safetensors")
    assert one.files == {"model.safetensors": ["a", "tied"]} and not one.sharded


def _run(*args):
    """A command in a fresh interpreter, outside the source folder (whose pyckpt/ has no native
    module and would shadow the installed package)."""
    import subprocess
    import sys
    import tempfile
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=300,
                          cwd=tempfile.gettempdir())


def test_command_line_takes_zero_to_fp32_flags(checkpoints, tmp_path):
    ck = checkpoints["s2_fp32_dp4"]
    ref = _zero_to_fp32(ck.tag_dir, "bf16")
    limit = str(max(v.numel() * v.element_size() for v in ref.values()) * 2 + 1)  # several shards
    out = tmp_path / "hf"
    proc = _run("-m", "pyckpt.export", ck.root, out, "-t", ck.tag, "--safe_serialization", "--max_shard_size", limit,
                "--dtype", "bf16", "--json", "--quiet")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["dtype"] == "bfloat16" and report["files"] == len(os.listdir(out)) >= 3  # shards + index
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f for f in os.listdir(out) if f.endswith(".safetensors")}
    got, _ = _load_export(out)
    assert all(_same(got[k], ref[k].contiguous()) for k in ref) and set(got) == set(ref)
    # the console script runs the same command; a closing line names the output
    again = _run("-m", "pyckpt", "export", ck.root, tmp_path / "hf2", "--dtype", "bf16", "--max_shard_size", limit)
    assert again.returncode == 0, again.stderr
    assert "pyckpt: exported" in again.stderr and str(tmp_path / "hf2") in again.stderr
    assert sorted(os.listdir(tmp_path / "hf2")) == sorted(os.listdir(out))
    for f in os.listdir(out):
        assert (out / f).read_bytes() == (tmp_path / "hf2" / f).read_bytes()


def test_command_line_refusals_are_one_line_and_write_nothing(checkpoints, tmp_path):
    ck = checkpoints["s1_fp32_dp2"]
    missing = _run("-m", "pyckpt.export", tmp_path / "nope", tmp_path / "out")
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1 and "nope" in missing.stderr
    (tmp_path / "exists").mkdir()
    taken = _run("-m", "pyckpt.export", ck.root, tmp_path / "exists")
    assert taken.returncode == 1 and "exists" in taken.stderr and os.listdir(tmp_path / "exists") == []
    dry = _run("-m", "pyckpt.export", ck.root, tmp_path / "dry", "--dry-run")
    assert dry.returncode == 0 and "model.safetensors" in dry.stdout and not (tmp_path / "dry").exists()
    bad_tag = _run("-m", "pyckpt.export", ck.root, tmp_path / "t", "-t", "../escape")
    assert bad_tag.returncode == 1 and "not a folder name" in bad_tag.stderr
    usage = _run("-m", "pyckpt.export", ck.root, tmp_path / "u", "--dtype", "int8")
    assert usage.returncode == 2
    assert [p for p in os.listdir(tmp_path) if "pyckpt-tmp" in p or "pyckpt-old" in p] == []  # no staging left


def test_config_and_tokenizer_beside_the_checkpoint_are_copied_and_the_dtype_follows(checkpoints, tmp_path):
    import shutil
    ck = checkpoints["s2_bf16_dp2"]
    root = tmp_path / "checkpoint-3"  # the Trainer's layout: model files beside latest and the tag folder
    shutil.copytree(ck.root, root)
    config = {"architectures": ["Tiny"], "model_type": "tiny", "torch_dtype": "bfloat16", "hidden_size": 8}
    (root / "config.json").write_text(json.dumps(config))
    tokenizer = b'{"version": "1.0", "model": {"type": "WordLevel"}}\n'
    (root / "tokenizer.json").write_bytes(tokenizer)
    (root / "generation_config.json").write_text('{"do_sample": false}')
    export_hf(root, tmp_path / "fp32")
    assert (tmp_path / "fp32" / "tokenizer.json").read_bytes() == tokenizer
    assert (tmp_path / "fp32" / "generation_config.json").read_text() == '{"do_sample": false}'
    written = json.loads((tmp_path / "fp32" / "config.json").read_text())
    assert written == {**config, "torch_dtype": "float32"}
    report = export_hf(root, tmp_path / "auto", dtype="auto")
    assert report.dtype == "bfloat16"
    assert (tmp_path / "auto" / "config.json").read_text() == json.dumps(config)  # unchanged: copied as it is
    got, _ = _load_export(tmp_path / "auto")
    assert {t.dtype for t in got.values() if t.is_floating_point()} == {torch.bfloat16}
    # A config naming no dtype (transformers leaves the key out for a model built without one) is
    # float32 to from_pretrained: copied as it is for fp32, given the export's dtype otherwise.
    plain = {k: v for k, v in config.items() if k != "torch_dtype"}
    (root / "config.json").write_text(json.dumps(plain))
    export_hf(root, tmp_path / "plain_fp32")
    assert (tmp_path / "plain_fp32" / "config.json").read_text() == json.dumps(plain)
    export_hf(root, tmp_path / "plain_bf16", dtype="bf16")
    assert json.loads((tmp_path / "plain_bf16" / "config.json").read_text()) == {**plain, "dtype": "bfloat16"}
    os.remove(root / "config.json")
    os.mkfifo(root / "config.json")  # a special file where the config should be: refused, not read
    with pytest.raises(Exception, match="config.json"):
        export_hf(root, tmp_path / "fifo")
    assert not (tmp_path / "fifo").exists()


def _zero_to_fp32_files(ck, out, dtype, safe):
    """DeepSpeed's own convert function; without max_shard_size it needs no huggingface_hub."""
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

    convert_zero_checkpoint_to_state_dict(str(ck.root), str(out), dtype=TORCH[dtype], max_shard_size=None,
                                          safe_serialization=safe, tag=ck.tag)


@pytest.mark.parametrize("name,dtype", [("s2_fp32_dp4", "fp32"), ("s3_bf16_dp3", "bf16"), ("s1_fp32_dp2", "fp16")])
def test_safetensors_file_is_byte_identical_to_zero_to_fp32s(checkpoints, tmp_path, name, dtype):
    ck = checkpoints[name]
    _zero_to_fp32_files(ck, tmp_path / "ref", dtype, safe=True)
    export_hf(ck.root, tmp_path / "ours", dtype=dtype)
    assert os.listdir(tmp_path / "ours") == ["model.safetensors"]
    assert (tmp_path / "ours" / "model.safetensors").read_bytes() == (tmp_path / "ref" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("name", ["s2_bf16_frozen_tied", "s3_frozen_tied", "s2_fp32_dp3"])
def test_torch_bin_equals_zero_to_fp32s_and_keeps_aliases_shared(checkpoints, tmp_path, name):
    ck = checkpoints[name]
    _zero_to_fp32_files(ck, tmp_path / "ref", "fp32", safe=False)
    export_hf(ck.root, tmp_path / "ours", torch_bin=True)
    assert os.listdir(tmp_path / "ours") == ["pytorch_model.bin"]
    ref = torch.load(tmp_path / "ref" / "pytorch_model.bin", weights_only=True)
    got = torch.load(tmp_path / "ours" / "pytorch_model.bin", weights_only=True)
    assert list(got) == list(ref)
    assert all(_same(got[k], ref[k].contiguous()) for k in ref)
    shared = lambda sd: {(a, b) for a in sd for b in sd if a < b and sd[a].data_ptr() == sd[b].data_ptr()}
    assert shared(got) == shared(ref)
    if "tied" in name:
        assert shared(got)  # the case is really tied


@pytest.mark.parametrize("name,dtype", [("s2_bf16_frozen_tied", None), ("s3_fp32_dp2_subgroups", "bf16"),
                                        ("tp_s2_bf16", None)])
def test_lazy_state_dict_holds_zero_to_fp32s_tensors(checkpoints, pyckpt_universal, name, dtype):
    import pyckpt
    ck = checkpoints[name]
    sd = pyckpt.state_dict(ck.root, dtype=dtype)
    if name.startswith("tp_"):  # zero_to_fp32 refuses TP: the universal masters are the reference
        zero = pyckpt_universal[name] / "zero"
        for key in list(sd)[-3:]:
            obj = torch.load(zero / key / "fp32.pt", weights_only=True)
            assert _same(sd[key].reshape(-1), (obj["param"] if isinstance(obj, dict) else obj).reshape(-1))
        return
    ref = _zero_to_fp32(ck.tag_dir, dtype)
    assert list(sd) == list(ref) and len(sd) == len(ref)
    for key in ref:
        assert _same(sd[key], ref[key].contiguous()), key
    with pytest.raises(KeyError):
        sd["no.such.parameter"]


@pytest.mark.parametrize("key,value,problem", [
    ("buffer_names", ["../escape"], "buffer_names"),
    ("buffer_names", "running_mean", "must be a list"),
    ("shared_params", {"lm_head.weight": 7}, "shared_params"),
    ("shared_params", {"a/b": "embed.weight"}, "shared_params key"),
    ("frozen_param_fragments", {"w": [1, 2]}, "must be a tensor"),
])
def test_hostile_model_state_fields_the_export_reads_are_refused(tmp_path, key, value, problem):
    """Fields only the export reads (buffers, tied aliases, frozen fragments) are checked where the
    file is read: one error naming the file and the key, nothing else read."""
    from pyckpt.zero.model_states import read_model_states
    from pyckpt.errors import CheckpointFormatError
    from pyckpt.formats.torch_zip import SourceFile

    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.zeros(2)}, "param_shapes": [{"w": torch.Size([2])}], key: value}, path)
    with pytest.raises(CheckpointFormatError, match=problem) as ei:
        read_model_states(SourceFile(str(path)))
    assert str(ei.value).startswith(str(path))


def test_a_config_that_is_not_a_json_object_is_refused_before_anything_is_written(checkpoints, tmp_path):
    import shutil
    root = tmp_path / "ck"
    shutil.copytree(checkpoints["s1_fp32_dp2"].root, root)
    (root / "config.json").write_text("[1, 2]")
    with pytest.raises(Exception, match="config.json: a model config must be a JSON object"):
        export_hf(root, tmp_path / "out")
    (root / "config.json").write_text("{not json")
    with pytest.raises(Exception, match="config.json: not a readable model config"):
        export_hf(root, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# A config.json beside the checkpoint is parsed, so it is hostile input like the shards (issue 36,
# item 8): each of these must be one line naming the file and the rule, from every reader of it.
HOSTILE_CONFIGS = {
    # name: (the file's bytes, what the message must say)
    "infinity": (b'{"model_type": "llama", "num_attention_heads": Infinity}', "Infinity is not a JSON number"),
    "nan": (b'{"model_type": "llama", "dtype": NaN}', "NaN is not a JSON number"),
    "float_overflow": (b'{"model_type": "llama", "rope_theta": 1e999}', "beyond a float's range"),
    "deep_lists": (b'{"model_type": "llama", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                   "nested deeper than 64 levels"),
    "deep_unclosed": (b'{"x": ' + b"[" * 100_000, "nested deeper than 64 levels"),
    "huge_integer": (b'{"model_type": "llama", "vocab_size": ' + b"7" * 100_000 + b"}",
                     "an integer of 100000 digits"),
    "duplicate_keys": (b'{"model_type": "llama", "dtype": "bfloat16", "dtype": "float32"}',
                       "the key 'dtype' appears twice"),
    "top_level_list": (b'[{"model_type": "llama"}]', "must be a JSON object, not an array"),
    "top_level_number": (b"7", "must be a JSON object, not a number"),
    "invalid_utf8": (b'{"model_type": "ll\xff\xfeama"}', "not UTF-8 text"),
    "not_json": (b"{not json", "not JSON"),
}


@pytest.mark.parametrize("config", list(HOSTILE_CONFIGS))
@pytest.mark.parametrize("dtype", ["fp32", "auto"])
def test_a_hostile_config_beside_the_checkpoint_is_one_line_naming_it(tmp_path, config, dtype):
    """The export reads config.json for its dtype ("auto") and copies it either way: NaN or an
    infinity, nesting deeper than the parser should recurse, a 100,000-digit integer, a key given
    twice, a top level other than an object or bytes that are not UTF-8 are each refused naming the
    file and the rule, before anything is written; the checkpoint is unchanged."""
    import pyckpt.testing as mc
    from compare import digest
    from pyckpt.errors import CheckpointFormatError

    root = mc.make_checkpoint(tmp_path / "ck", params=20000, dp=2, stage=2).parent
    data, rule = HOSTILE_CONFIGS[config]
    (root / "config.json").write_bytes(data)
    before = digest(root)
    with pytest.raises(CheckpointFormatError) as ei:
        export_hf(root, tmp_path / "out", dtype=dtype)
    message = str(ei.value)
    assert message.startswith(f"{root / 'config.json'}: ") and rule in message, message
    assert "\n" not in message and len(message) < 400, message
    assert not (tmp_path / "out").exists() and sorted(os.listdir(tmp_path)) == ["ck"]
    assert digest(root) == before


def test_the_json_reader_keeps_what_a_model_config_holds():
    """What the refusals leave alone: nesting up to the bound, brackets and quotes inside strings,
    long strings, 20-digit integers, negative and fractional numbers, unicode."""
    from pyckpt.formats.json_file import MAX_DEPTH, parse_json_object

    nested = "[" * (MAX_DEPTH - 1) + "1" + "]" * (MAX_DEPTH - 1)
    text = ('{"a": ' + nested + ', "s": "[[[{{{\\"]]]", "big": 18446744073709551615, "neg": -3, '
            '"f": 1e-05, "u": "\u00e9\u4e2d", "brackets": "' + "[" * 1000 + '"}')
    value = parse_json_object(text.encode(), "config.json")
    assert value == json.loads(text)
    with pytest.raises(ValueError, match="nested deeper"):
        parse_json_object(('{"a": [' + nested + "]}").encode(), "config.json")


def test_a_parameter_named_like_the_safetensors_metadata_key_is_refused_not_written(checkpoints, tmp_path):
    """``__metadata__`` is safetensors' header key for string metadata: a tensor under that name makes
    a file the reference reader refuses. Refused for safetensors (one line, nothing written);
    pytorch_model.bin has no such key and holds it."""
    import shutil

    from edit import rewrite
    from pyckpt.errors import UnsupportedCheckpointError

    root = tmp_path / "ck"
    shutil.copytree(checkpoints["s3_fp32_dp2_subgroups"].root, root)
    tag = root / checkpoints["s3_fp32_dp2_subgroups"].tag
    first = []

    def edit(obj):
        group = obj["param_shapes"][0]
        first.append(next(iter(group)))
        items = [("__metadata__" if k == first[0] else k, v) for k, v in group.items()]
        group.clear()
        group.update(items)

    for model in tag.glob("*model_states.pt"):
        rewrite(model, edit)
    with pytest.raises(UnsupportedCheckpointError, match="'__metadata__' cannot be stored in a safetensors") as ei:
        export_hf(root, tmp_path / "out")
    assert "\n" not in str(ei.value) and "--torch-bin" in str(ei.value)
    assert not (tmp_path / "out").exists()
    export_hf(root, tmp_path / "bin", torch_bin=True)
    state = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    assert "__metadata__" in state and first[0] not in state
