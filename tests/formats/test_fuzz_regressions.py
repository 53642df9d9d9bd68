"""Deterministic regressions for what fuzzing (tests/formats/test_fuzz.py) found: each input below once
ended in something other than a one-line pyckpt error naming the file (a gap or an overlap only the
native executor's plan check caught, an output torch refused to load, a message naming no file).
Each is now refused where the data enters, naming the file and the rule."""

import io
import pickletools
import struct
import zipfile

import pytest

import pyckpt
from pyckpt import CheckpointFormatError
from pyckpt.formats.torch_zip import SourceFile
from pyckpt.zero.autoep.layers import zero12_dp_ranks, zero12_param_info
from pyckpt.errors import AutoEPError, PyckptError
from pyckpt.formats.pickle_read import loads

from compare import digest
from edit import copy_checkpoint, rewrite


def _refused(root, tmp_path, *expected):
    """Converting ``root`` fails with one line naming a file under it and containing ``expected``;
    nothing is published and the input is unchanged."""
    before = digest(root)
    out = tmp_path / "out" / "u"
    with pytest.raises(PyckptError) as err:
        pyckpt.convert_to_universal(root, out, workers=1, progress=False)
    msg = str(err.value)
    assert "\n" not in msg and str(root) in msg, msg
    for text in expected:
        assert text in msg, msg
    assert not out.exists()
    assert digest(root) == before
    return msg


# -- AutoTP affine maps: a piece outside its tensor, or pieces that do not tile it -------------------

def _affine(obj, param):
    return obj["universal_checkpoint_info"]["affine_map"]["params"][f"^{param.replace('.', chr(92) + '.')}$"]


K_BIAS = "model.layers.0.self_attn.k_proj.bias"
Q_WEIGHT = "model.layers.0.self_attn.q_proj.weight"


def _edit_affine(tag, param, edit):
    for model in sorted(tag.glob("mp_rank_*_model_states.pt")):
        rewrite(model, lambda obj: edit(_affine(obj, param)))


def test_affine_piece_moved_off_its_place_leaves_a_gap(checkpoints, tmp_path):
    # Found: source offset 1 -> 2 left element 1 unwritten; only the executor noticed ("gap").
    root, tag = copy_checkpoint(checkpoints["tp_s1_fp32"].tag_dir, tmp_path)

    def shift(amap):
        pc = amap["ranks"][0]["pieces"][0]
        pc["source"] = [pc["source"][0], [pc["source"][1][0] + 1]]

    _edit_affine(tag, K_BIAS, shift)
    _refused(root, tmp_path, "mp_rank_00_model_states.pt", K_BIAS, "do not tile")


def test_affine_piece_with_negative_stride_is_refused(checkpoints, tmp_path):
    # Found: a stride of -63 became a negative destination offset in the op table.
    root, tag = copy_checkpoint(checkpoints["tp_s1_fp32"].tag_dir, tmp_path)

    def negative(amap):
        pc = amap["ranks"][0]["pieces"][0]
        pc["source"] = [pc["source"][0], [-63]]

    _edit_affine(tag, K_BIAS, negative)
    _refused(root, tmp_path, "mp_rank_00_model_states.pt", "strides[0] is -63")


def test_affine_logical_shape_larger_than_its_pieces_is_refused(checkpoints, tmp_path):
    # Found: logical_shape [16, 2**31 - 1] asked the executor for a 128 GiB record with one piece.
    root, tag = copy_checkpoint(checkpoints["tp_s1_fp32"].tag_dir, tmp_path)
    _edit_affine(tag, Q_WEIGHT, lambda amap: amap["logical_shape"].__setitem__(1, 2**31 - 1))
    _refused(root, tmp_path, "mp_rank_00_model_states.pt", Q_WEIGHT)


def test_affine_piece_reaching_past_the_shard_is_refused(checkpoints, tmp_path):
    root, tag = copy_checkpoint(checkpoints["tp_s1_fp32"].tag_dir, tmp_path)

    def past(amap):
        pc = amap["ranks"][1]["pieces"][0]
        pc["dest"] = [pc["dest"][0] + 1, pc["dest"][1]]

    _edit_affine(tag, Q_WEIGHT, past)
    _refused(root, tmp_path, "mp_rank_00_model_states.pt", "past the", "rank's shard")


def test_affine_pattern_that_is_not_a_regex_is_refused(checkpoints, tmp_path):
    root, tag = copy_checkpoint(checkpoints["tp_s1_fp32"].tag_dir, tmp_path)

    def bad_pattern(obj):
        params = obj["universal_checkpoint_info"]["affine_map"]["params"]
        params["(unclosed"] = params.pop(next(iter(params)))

    for model in sorted(tag.glob("mp_rank_*_model_states.pt")):
        rewrite(model, bad_pattern)
    _refused(root, tmp_path, "mp_rank_00_model_states.pt", "not a valid regular expression")


# -- torch.Size and opcodes: what parses here must load in torch -----------------------------------

def _size_pickle(dims_op: bytes) -> bytes:
    # torch.Size(<dims>) as torch.save writes it: GLOBAL, the argument tuple, REDUCE.
    return b"\x80\x02ctorch\nSize\nq\x00" + dims_op + b"\x85q\x01Rq\x02."


@pytest.mark.parametrize("dims_op, what", [
    (b"(X\x01\x00\x00\x007t", "str"),                             # ('7',): int() would coerce it
    (b"(G" + struct.pack(">d", 1.5) + b"t", "float"),             # (1.5,)
    (b"(\x8a\x09" + (2**64).to_bytes(9, "little") + b"t", "64 bits"),
    (b"X\x02\x00\x00\x0012", "str"),                              # a string, not a sequence
])
def test_torch_size_of_non_integers_is_refused(dims_op, what):
    # Found: a model-states file holding torch.Size(('7',)) parsed (int('7') == 7), was copied into
    # the output verbatim, and torch.load then failed on it.
    with pytest.raises(CheckpointFormatError, match=rf"^f\.pt/data\.pkl: .*torch\.Size.*{what}"):
        loads(_size_pickle(dims_op), where="f.pt/data.pkl")


def test_torch_size_of_integers_still_parses():
    assert loads(_size_pickle(b"(K\x02K\x03t"), where="f.pt") == (2, 3)


def _with_pickle(path, transform):
    with zipfile.ZipFile(path) as zin:
        items = [(i.filename, zin.read(i.filename)) for i in zin.infolist()]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zout:
        for name, body in items:
            zout.writestr(name, transform(body) if name.endswith("/data.pkl") else body)
    path.write_bytes(buf.getvalue())


def test_model_states_with_an_opcode_torch_refuses_is_not_copied(checkpoints, tmp_path):
    # Found: an int in ds_config replaced by SHORT_BINBYTES b'x'. CPython's unpickler reads it, so
    # the file passed and was copied verbatim; torch.load(weights_only=True) then refused the copy.
    root, tag = copy_checkpoint(checkpoints["s2_bf16_dp2"].tag_dir, tmp_path)
    model = sorted(tag.glob("*model_states.pt"))[0]

    def swap(pkl):
        ops = list(pickletools.genops(pkl))
        key = next(i for i, (_, arg, _) in enumerate(ops) if arg == "mp_world_size")
        op, _, at = next(o for o in ops[key + 1:] if o[0].name in ("BININT1", "BININT", "BININT2"))
        end = at + 1 + {"BININT1": 1, "BININT2": 2, "BININT": 4}[op.name]
        return pkl[:at] + b"C\x01x" + pkl[end:]

    _with_pickle(model, swap)
    SourceFile(model).load()  # it parses
    with pytest.raises(CheckpointFormatError, match=r"data\.pkl uses pickle opcode SHORT_BINBYTES"):
        SourceFile(model).check_copyable()
    _refused(root, tmp_path, model.name, "SHORT_BINBYTES")


def test_real_model_states_pass_the_opcode_check(checkpoints):
    for name in ("s2_bf16_dp2", "s3_fp32_dp2_subgroups", "tp_s1_fp32", "ep_s3_fp32"):
        for model in checkpoints[name].tag_dir.glob("*model_states.pt"):
            SourceFile(model).check_copyable()


def _le8(n):
    return n.to_bytes(8, "little")


# Every opcode torch.save never writes, spliced in right after PROTO 2 of a real torch.save pickle:
# (name, allowed bytes before it, the opcode with its argument, bytes after it, whether the result
# still parses in pyckpt's reader). Where it parses, the splice leaves the stack as it found it, so
# only the opcode check stands between the file and a verbatim copy torch.load refuses.
FOREIGN_OPCODES = [
    ("INT", b"", b"I1\n", b"0", True),
    ("LONG", b"", b"L1L\n", b"0", True),
    ("LONG4", b"", b"\x8b\x01\x00\x00\x00\x01", b"0", True),
    ("STRING", b"", b"S'x'\n", b"0", True),
    ("BINSTRING", b"", b"T\x01\x00\x00\x00x", b"0", True),
    ("BINBYTES", b"", b"B\x01\x00\x00\x00x", b"0", True),
    ("SHORT_BINBYTES", b"", b"C\x01x", b"0", True),
    ("BINBYTES8", b"", b"\x8e" + _le8(1) + b"x", b"0", True),
    ("BYTEARRAY8", b"", b"\x96" + _le8(1) + b"x", b"0", True),
    ("NEXT_BUFFER", b"", b"\x97", b"0", False),  # no out-of-band buffers to take
    ("READONLY_BUFFER", b"N", b"\x98", b"0", False),  # None is no buffer; anything that is needs a foreign op
    ("UNICODE", b"", b"Vx\n", b"0", True),
    ("SHORT_BINUNICODE", b"", b"\x8c\x01x", b"0", True),
    ("BINUNICODE8", b"", b"\x8d" + _le8(1) + b"x", b"0", True),
    ("FLOAT", b"", b"F1.5\n", b"0", True),
    ("LIST", b"(", b"l", b"0", True),
    ("DICT", b"(", b"d", b"0", True),
    ("ADDITEMS", b"\x8f(", b"\x90", b"0", True),
    ("FROZENSET", b"(", b"\x91", b"0", True),
    ("POP", b"N", b"0", b"", True),
    ("DUP", b"N", b"2", b"00", True),
    ("POP_MARK", b"(", b"1", b"", True),
    ("GET", b"Nq\x00", b"g0\n", b"00", True),
    ("PUT", b"N", b"p0\n", b"0", True),
    ("MEMOIZE", b"N", b"\x94", b"0", True),
    ("EXT1", b"", b"\x82\x01", b"0", False),  # no extension registry entry
    ("EXT2", b"", b"\x83\x01\x00", b"0", False),
    ("EXT4", b"", b"\x84\x01\x00\x00\x00", b"0", False),
    ("STACK_GLOBAL", b"X\x0b\x00\x00\x00collectionsX\x0b\x00\x00\x00OrderedDict", b"\x93", b"0", True),
    ("INST", b"(", b"icollections\nOrderedDict\n", b"0", True),
    ("OBJ", b"(ccollections\nOrderedDict\n", b"o", b"0", True),
    ("NEWOBJ_EX", b"ccollections\nOrderedDict\n)}", b"\x92", b"0", True),
    ("FRAME", b"", b"\x95" + _le8(0), b"", True),
    ("PERSID", b"", b"P0\n", b"0", False),  # not a torch storage id
]


def test_the_foreign_opcode_cases_cover_every_opcode_torch_refuses():
    from pyckpt.native import TORCH_SAVE_OPCODES
    names = [case[0] for case in FOREIGN_OPCODES]
    assert sorted(names) == sorted({op.name for op in pickletools.opcodes} - TORCH_SAVE_OPCODES)


@pytest.mark.parametrize("name, before, op, after, parses", FOREIGN_OPCODES, ids=[c[0] for c in FOREIGN_OPCODES])
def test_every_opcode_torch_save_never_writes_is_not_copied(tmp_path, name, before, op, after, parses):
    import torch
    path = _saved(tmp_path)
    _with_pickle(path, lambda pkl: pkl[:2] + before + op + after + pkl[2:])
    if parses:
        SourceFile(path).load()
    with pytest.raises(CheckpointFormatError) as err:
        SourceFile(path).check_copyable()
    assert str(err.value) == (f"{path}: data.pkl uses pickle opcode {name} (at byte {2 + len(before)}), which "
                              "torch.save never writes and torch.load(weights_only=True) refuses")
    with pytest.raises(Exception):  # the premise: torch's loader refuses the copy
        torch.load(path, weights_only=True)


def test_a_byte_that_is_no_opcode_is_refused_by_the_opcode_check_too(tmp_path):
    path = _saved(tmp_path)
    _with_pickle(path, lambda pkl: pkl[:2] + b"\xff" + pkl[2:])
    with pytest.raises(CheckpointFormatError, match=rf"^{path}: data\.pkl has byte 0xff at byte 2, which is no "
                                                    "pickle opcode"):
        SourceFile(path).check_copyable()


# -- AutoEP: every refusal names a file -----------------------------------------------------------------

LAYER = {"moe_layer_id": 0, "expert_key_prefix": "model.layers.0.mlp.experts", "num_experts": 8,
         "num_local_experts": 4, "ep_size": 2}


@pytest.mark.parametrize("entry, rule", [
    ({k: v for k, v in LAYER.items() if k != "ep_size"}, "missing fields"),
    ({**LAYER, "num_experts": 0}, "num_experts must be a positive integer"),
    ({**LAYER, "num_local_experts": "4"}, "num_local_experts must be a positive integer"),
    ({**LAYER, "num_experts": 9}, "expert count mismatch"),
])
def test_autoep_metadata_refusals_name_the_file(entry, rule):
    # Found: AutoEP refusals kept DeepSpeed's wording, which names no file.
    with pytest.raises(AutoEPError, match=rf"^ckpt/mp_rank_00_model_states\.pt: .*{rule}"):
        zero12_param_info([entry], "ckpt/mp_rank_00_model_states.pt")
    with pytest.raises(AutoEPError, match=r"^ckpt/m\.pt: AutoEP metadata must be a non-empty list"):
        zero12_param_info([], "ckpt/m.pt")


def test_autoep_dp_not_divisible_by_ep_names_the_file():
    with pytest.raises(AutoEPError, match=r"^ckpt/m\.pt: ZeRO DP degree 3 is not divisible by AutoEP size 2"):
        zero12_dp_ranks(0, 3, 2, False, "ckpt/m.pt")


def test_autoep_fragment_size_mismatch_names_the_shards(checkpoints, tmp_path):
    # Found: "AutoEP exp_avg fragment size mismatch ...: got 19, expected 240." with no file in it,
    # from a fragment_address whose numel was edited.
    root, tag = copy_checkpoint(checkpoints["ep_s1_fp32"].tag_dir, tmp_path)
    shard = sorted(tag.glob("*zero_pp_rank_0_*optim_states.pt"))[0]

    def shrink(obj):
        mapping = obj["optimizer_state_dict"]["param_slice_mappings"]
        for group in mapping:
            for name, frag in group.items():
                if name.endswith("experts.w1"):
                    frag._state["numel"] -= 1
                    return

    rewrite(shard, shrink)
    msg = _refused(root, tmp_path, "experts.w1", "(in ")
    assert "zero_pp_rank_" in msg, msg


# -- ZIP fields torch.load reads and pyckpt's reader did not: the copy would not load -----------------

def _saved(tmp_path):
    import torch
    path = tmp_path / "m.pt"
    torch.save({"w": torch.arange(6, dtype=torch.float32)}, path)
    return path


def _central_entry(data: bytes, suffix: bytes) -> int:
    """Offset of the central-directory header of the member whose name ends with ``suffix``."""
    at = data.index(b"PK\x01\x02")
    while True:
        name_len = int.from_bytes(data[at + 28:at + 30], "little")
        if data[at + 46:at + 46 + name_len].endswith(suffix):
            return at
        at = data.index(b"PK\x01\x02", at + 4)


def _set_record(path, name: bytes, value: bytes):
    """Replace a small record's bytes in place (same length; the CRC is fixed up in both headers)."""
    import zlib
    data = bytearray(path.read_bytes())
    sf = SourceFile(path)
    off, size, _ = sf.members[f"{sf.prefix}/{name.decode()}"]
    assert len(value) == size
    data[off:off + size] = value
    crc = zlib.crc32(value).to_bytes(4, "little")
    cd = _central_entry(bytes(data), b"/" + name)
    data[cd + 16:cd + 20] = crc
    local = int.from_bytes(data[cd + 42:cd + 46], "little")
    data[local + 14:local + 18] = crc
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name, value", [(b"byteorder", b"ittleP"), (b"version", b"4P"),
                                         (b".storage_alignment", b"\xc0\x1c"),
                                         (b".format_version", b"x")])
def test_metadata_record_torch_cannot_parse_is_not_copied(tmp_path, name, value):
    # Found by fuzzing whole conversions: a copied model-states file with byteorder 'ittleP' loaded
    # in pyckpt (it never reads that record) and failed in torch.load.
    path = _saved(tmp_path)
    _set_record(path, name, value)
    SourceFile(path).load()
    with pytest.raises(CheckpointFormatError, match=rf"^{path}: record .*{name.decode()} is not"):
        SourceFile(path).check_copyable()


def test_metadata_records_torch_writes_pass(tmp_path):
    SourceFile(_saved(tmp_path)).check_copyable()


CENTRAL_FIELDS = [
    (9, 0x20, "general-purpose flag 0x2000 (central directory encrypted)"),
    (34, 0x02, "disk number start 2 (multi-disk archive)"),
    (38, 0x10, "external attributes with the MS-DOS directory bit"),
]


def _with_central_field(tmp_path, field, value):
    path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    cd = _central_entry(bytes(data), b"/data.pkl")
    data[cd + field] |= value
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("field, value, what", CENTRAL_FIELDS)
def test_torch_refuses_these_central_directory_fields(tmp_path, field, value, what):
    # The premise of the test below: these fields really break torch.load.
    import torch
    with pytest.raises(Exception):
        torch.load(_with_central_field(tmp_path, field, value), weights_only=True)


@pytest.mark.parametrize("field, value, what", CENTRAL_FIELDS)
def test_central_directory_field_torch_refuses_is_refused(tmp_path, field, value, what):
    # Found by fuzzing (a byte of a copied model-states file's central directory set to 0xff); the
    # native reader (csrc/archive.cpp) refuses them.
    path = _with_central_field(tmp_path, field, value)
    with pytest.raises(CheckpointFormatError, match=rf"^{path}: "):
        sf = SourceFile(path)
        sf.load()
        sf.check_copyable()
