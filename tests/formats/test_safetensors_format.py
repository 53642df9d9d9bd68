"""pyckpt's safetensors layout is byte-identical to safetensors.torch.save_file's (pyckpt writes the
format and never reads it back: the reference reader checks what it wrote)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pyckpt.formats.safetensors import DTYPES, TensorEntry, layout

TORCH = {name: getattr(torch, name) for name in DTYPES}


def _write(path, lay, tensors):
    """The file pyckpt's executor would write: the header, then each tensor's bytes at its offset."""
    buf = bytearray(lay.file_size)
    buf[:len(lay.header)] = lay.header
    for name, t in tensors.items():
        raw = t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        buf[lay.offsets[name]:lay.offsets[name] + len(raw)] = raw
    path.write_bytes(bytes(buf))


names = st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=12)
entries = st.dictionaries(names, st.tuples(st.sampled_from(sorted(DTYPES)),
                                           st.lists(st.integers(0, 5), min_size=0, max_size=3)),
                          min_size=1, max_size=8)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(spec=entries, with_metadata=st.booleans())
def test_layout_is_byte_identical_to_save_file(tmp_path_factory, spec, with_metadata):
    tmp = tmp_path_factory.mktemp("st")
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, (dtype, shape) in spec.items():
        t = torch.randint(0, 2, tuple(shape), generator=g) if dtype == "bool" else torch.randn(tuple(shape),
                                                                                              generator=g) * 50
        tensors[name] = t.to(TORCH[dtype])
    metadata = {"format": "pt"} if with_metadata else None
    save_file(tensors, str(tmp / "ref.safetensors"), metadata=metadata)
    lay = layout([TensorEntry(n, d, tuple(s)) for n, (d, s) in spec.items()], metadata)
    _write(tmp / "ours.safetensors", lay, tensors)
    assert (tmp / "ours.safetensors").read_bytes() == (tmp / "ref.safetensors").read_bytes()
    back = load_file(str(tmp / "ours.safetensors"))
    assert set(back) == set(tensors)
    assert all(torch.equal(back[n], tensors[n]) for n in tensors)
    with safe_open(str(tmp / "ours.safetensors"), "pt") as f:
        assert (f.metadata() or {}) == (metadata or {})


def test_dtype_table_matches_torch_item_sizes():
    assert {n: torch.empty(0, dtype=TORCH[n]).element_size() for n in DTYPES} == {n: s for n, (_, s) in DTYPES.items()}
    assert np.dtype("float32").itemsize == DTYPES["float32"][1]


def test_layout_refuses_a_tensor_named_like_the_metadata_key():
    with pytest.raises(ValueError, match="__metadata__"):
        layout([TensorEntry("__metadata__", "float32", (2,))], {"format": "pt"})
