"""Where each entry of a torch.distributed.checkpoint (DCP) folder lives: its flattened key, its
chunks, and which data file holds each chunk.

DCP stores a nested state dict flattened: ``{"optim": {"state": {fqn: {"exp_avg": t}}}}`` is the key
``optim.state.<fqn>.exp_avg`` with the path ``("optim", "state", fqn, "exp_avg")`` (the path is what
``dcp_to_torch_save`` rebuilds the nesting from; list positions are ints in it). A tensor is a list of
chunks (offsets and sizes per dimension), each a torch.save archive of its own inside a data file,
and DCP's reader loads whole chunks: a rank loading a shard reads every chunk its shard overlaps.
pyckpt therefore cuts each tensor along its first dimension into chunks of about ``chunk_bytes``
(default 16 MiB), whole rows each: FSDP2 shards parameters along dimension 0, so a load at any world
size reads its own rows plus at most one partial chunk at each end of its shard.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

from ..planning.plan import Piece
from ..tensors import ITEMSIZE, NewTensor, numel
from ..native import KIND_COPY, KIND_SOURCE_DTYPE

DEFAULT_CHUNK_BYTES = 16 << 20
# A data file is written by one thread of one process at a time; several let the executor's workers
# write side by side (two writers of one file serialize on its inode lock), and their number stays
# bounded whatever the model's size.
TARGET_FILE_BYTES = 256 << 20
MAX_FILES = 64

# What get_state_dict(model, optimizer) nests a torch Adam/AdamW state under, in FSDP2 scripts and
# torchtitan-style checkpointers; a user may name others (model_key "" puts the model's entries at
# the top level, as a model-only DCP checkpoint has them).
MODEL_KEY = "model"
OPTIM_KEY = "optim"
# "nested": get_state_dict's optimizer state ({"state": {fqn: ...}, "param_groups": [{..., "params": [fqn]}]});
# "flat": the same with StateDictOptions(flatten_optimizer_state_dict=True)
OPTIM_LAYOUTS = ("nested", "flat")
# (model_key, optim_key, optim_layout) of torchtitan's checkpointer: the model's entries at the top level, the
# optimizer flattened under "optimizer" (components/checkpointer, components/optimizer/utils.py)
TORCHTITAN_LAYOUT = ("", "optimizer", "flat")


def torchtitan_options_problem(torchtitan: bool, hf_names: bool, model_key: str, optim_key: str, optim_layout: str,
                               spell=lambda option: option) -> Optional[str]:
    """Why options given with ``torchtitan`` contradict it (None where they do not): torchtitan's checkpointer
    fixes the names and the layout, so only their defaults or torchtitan's own values may be given.
    ``spell(option)`` names an option as the caller's user typed it (the API's keyword, the CLI's flag)."""
    if not torchtitan:
        return None
    fixed = ("torchtitan's checkpointer fixes the names and the layout (its own parameter names, the model at the "
             "top level, the optimizer flattened under 'optimizer')")
    if hf_names:
        return f"{fixed}: {spell('hf_names')} names the parameters another way; leave it out"
    if (model_key, optim_key, optim_layout) not in ((MODEL_KEY, OPTIM_KEY, "nested"), TORCHTITAN_LAYOUT):
        return (f"{fixed}: leave {spell('model_key')}, {spell('optim_key')} and {spell('optim_layout')} unset")
    return None


def flat_key(path: Sequence[Any]) -> str:
    """DCP's flattened key of a nested path: its parts joined by dots."""
    return ".".join(str(p) for p in path)


@dataclass
class Chunk:
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    tensor: NewTensor
    file: int = -1  # data file index, dealt by assign_files
    position: int = -1  # archive index within that file


@dataclass
class TensorEntry:
    path: Tuple[Any, ...]
    dtype: str
    shape: Tuple[int, ...]
    chunks: List[Chunk]
    # an entry that is another's tensor under a second name (tied weights): its chunks are the holder's
    same_as: Optional["TensorEntry"] = None

    @property
    def key(self) -> str:
        return flat_key(self.path)


@dataclass
class BytesEntry:
    """A non-tensor leaf (a hyper-parameter, the list of a param group's names): torch.save'd whole."""

    path: Tuple[Any, ...]
    value: Any
    file: int = -1
    position: int = -1

    @property
    def key(self) -> str:
        return flat_key(self.path)


@dataclass
class Layout:
    tensors: List[TensorEntry] = field(default_factory=list)
    objects: List[BytesEntry] = field(default_factory=list)
    files: List[List[Any]] = field(default_factory=list)  # per data file: its Chunk/BytesEntry items in order


def narrow_bytes(t: NewTensor, start: int, nbytes: int, shape: Tuple[int, ...]) -> NewTensor:
    """Bytes [start, start + nbytes) of the contiguous tensor ``t`` as a tensor of ``shape``: its
    pieces cut to the range, no byte read. The range is whole rows along dimension 0, so a strided
    piece (a concatenation along a later dimension) has each of its rows wholly inside or outside."""
    out_item = ITEMSIZE[t.dtype]
    if t.data is not None:
        return NewTensor(t.dtype, shape, [], t.requires_grad, t.data[start:start + nbytes])
    end = start + nbytes
    pieces = []
    for p in t.pieces:
        in_item = out_item if p.src is None or p.kind == KIND_COPY else ITEMSIZE[KIND_SOURCE_DTYPE[p.kind]]
        row = p.nbytes // in_item * out_item  # destination bytes of one row
        if p.rows <= 1:
            lo, hi = max(start, p.dst_off), min(end, p.dst_off + row)
            if lo < hi:
                pieces.append(Piece(p.src, p.src_off + (lo - p.dst_off) // out_item * in_item,
                                    (hi - lo) // out_item * in_item, lo - start, p.kind))
            continue
        def rows_before(at: int) -> int:  # how many rows start before byte `at`
            return min(p.rows, max(0, -(-(at - p.dst_off) // p.stride)))

        first, last = rows_before(start), rows_before(end)
        for i, bound in ((first - 1, start), (last - 1, end)):
            if 0 <= i and p.dst_off + i * p.stride + row > bound:
                raise ValueError(f"a chunk boundary at byte {bound} cuts row {i} of a strided piece")
        if first < last:
            pieces.append(Piece(p.src, p.src_off + first * p.nbytes, p.nbytes, p.dst_off + first * p.stride - start,
                                p.kind, last - first, p.stride))
    return NewTensor(t.dtype, shape, pieces, t.requires_grad)


def chunk_tensor(t: NewTensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> List[Chunk]:
    """``t`` cut along dimension 0 into near-equal runs of whole rows of at most about ``chunk_bytes``
    (one chunk for a scalar, an empty tensor or a small one)."""
    shape = tuple(int(d) for d in t.shape)
    nbytes = numel(shape) * ITEMSIZE[t.dtype]
    if not shape or nbytes <= chunk_bytes or shape[0] <= 1:
        return [Chunk((0,) * len(shape), shape, t)]
    parts = min(shape[0], -(-nbytes // chunk_bytes))
    rows = -(-shape[0] // parts)
    row_bytes = nbytes // shape[0]
    out = []
    for r0 in range(0, shape[0], rows):
        r1 = min(shape[0], r0 + rows)
        sizes = (r1 - r0,) + shape[1:]
        out.append(Chunk((r0,) + (0,) * (len(shape) - 1), sizes, narrow_bytes(t, r0 * row_bytes,
                                                                              (r1 - r0) * row_bytes, sizes)))
    return out


def _item_bytes(item) -> int:
    if isinstance(item, Chunk):
        return numel(item.sizes) * ITEMSIZE[item.tensor.dtype]
    return 64  # a hyper-parameter: a few bytes of pickle


def assign_files(layout: Layout, min_files: int = 1) -> None:
    """Deals every chunk and object to a data file: as many files as TARGET_FILE_BYTES asks (at least
    ``min_files``, at most MAX_FILES unless ``min_files`` says more), largest item first to the file with
    the fewest bytes so far; each file keeps the items in layout order. Deterministic, so every rank
    of a launch computes the same layout."""
    items: List[Any] = [c for e in layout.tensors if e.same_as is None for c in e.chunks] + list(layout.objects)
    total = sum(_item_bytes(i) for i in items)
    count = max(min_files, min(MAX_FILES, -(-total // TARGET_FILE_BYTES)), 1)
    count = min(count, max(1, len(items)))
    order = sorted(range(len(items)), key=lambda j: -_item_bytes(items[j]))
    loads = [(0, f) for f in range(count)]
    owner = [0] * len(items)
    for j in order:
        load, f = heapq.heappop(loads)
        owner[j] = f
        heapq.heappush(loads, (load + _item_bytes(items[j]), f))
    layout.files = [[] for _ in range(count)]
    for j, item in enumerate(items):
        item.file = owner[j]
        item.position = len(layout.files[owner[j]])
        layout.files[owner[j]].append(item)


def data_file_name(index: int) -> str:
    """The name DCP's own writer gives its first file per rank; pyckpt's files are one per dealt share."""
    return f"__{index}_0.distcp"
