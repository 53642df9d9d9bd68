"""pyckpt's shard split and size parsing against huggingface_hub's own, on generated state dicts.

save_pretrained and zero_to_fp32 split weights with huggingface_hub's
``split_state_dict_into_shards_factory``; pyckpt does not import it (it is not a dependency), so
this holds pyckpt's ``split`` to it for arbitrary sizes, limits and tied aliases: the same files,
the same keys in each, in the same order, the same index.
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyckpt.huggingface.shards import parse_size, split

# Imported, not skipped when missing: huggingface_hub is a pinned test dependency.
from huggingface_hub import split_state_dict_into_shards_factory
from huggingface_hub.serialization._base import parse_size_to_int


class Stored:
    """A stand-in tensor: a size in bytes and the storage it lives in (aliases share one)."""

    def __init__(self, nbytes: int, storage: int):
        self.nbytes, self.storage = nbytes, storage


def _hub_split(keys, nbytes, aliases, limit, weights_name):
    storages = {}
    state = {}
    for key in keys:
        holder = aliases.get(key, key)
        if holder not in storages:
            storages[holder] = len(storages)
        state[key] = Stored(nbytes[holder], storages[holder])
    stem, _, ext = weights_name.rpartition(".")
    return split_state_dict_into_shards_factory(
        state, max_shard_size=limit, filename_pattern=stem + "{suffix}." + ext,
        get_storage_size=lambda t: t.nbytes, get_storage_id=lambda t: t.storage)


@st.composite
def state_dicts(draw):
    n = draw(st.integers(1, 40))
    keys = [f"layer.{i}.weight" for i in range(n)]
    nbytes = {k: draw(st.integers(0, 5000)) for k in keys}
    aliases = {}
    holders = list(keys)
    for i in range(draw(st.integers(0, 4))):
        target = draw(st.sampled_from(holders))
        alias = f"tied.{i}"
        at = draw(st.integers(keys.index(target) + 1, len(keys)))  # an alias comes after its holder
        keys.insert(at, alias)
        aliases[alias] = target
    return keys, nbytes, aliases


@settings(max_examples=400, deadline=None)
@given(state_dicts(), st.integers(1, 12000), st.sampled_from(["model.safetensors", "pytorch_model.bin"]))
def test_split_is_huggingface_hubs(case, limit, weights_name):
    keys, nbytes, aliases = case
    ours = split(keys, nbytes, aliases, limit, weights_name)
    theirs = _hub_split(keys, nbytes, aliases, limit, weights_name)
    assert ours.files == theirs.filename_to_tensors
    assert ours.weight_map() == theirs.tensor_to_filename
    assert ours.sharded == theirs.is_sharded
    assert ours.total_size == theirs.metadata["total_size"]
    if ours.sharded:
        index = json.loads(ours.index_json())
        assert index == {"metadata": {"total_size": theirs.metadata["total_size"]},
                         "weight_map": theirs.tensor_to_filename}


@pytest.mark.parametrize("text", ["5GB", "500MB", "1KB", "10GB", "2TB", "1.5GB", "0.5MB", "5gb", "3.25KB", " 2GB "])
def test_size_parsing_is_huggingface_hubs(text):
    assert parse_size(text) == parse_size_to_int(text)


def test_a_number_is_bytes():
    """An int is a number of bytes, as huggingface_hub takes it; so is a digit string (zero_to_fp32's
    --max_shard_size arrives as a string, and huggingface_hub's parser wants a unit on strings)."""
    assert parse_size("100") == parse_size(100) == 100 and parse_size(123456) == 123456
