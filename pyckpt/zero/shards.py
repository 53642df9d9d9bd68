"""A ZeRO optimizer shard (``*_optim_states.pt``) as a typed, validated record.

One file per dp rank and model-parallel rank. Under ZeRO-1/2 (``DeepSpeedZeroOptimizer`` and
``BF16_Optimizer``) it holds, per param group, the rank's flat fp32 partition with padding
stripped, the torch optimizer's state of that flat tensor (Adam moments of the same layout, the
step), and ``param_slice_mappings``: where each parameter's fragment sits in the partition. Under
ZeRO-3 it holds per sub-group the flat fp32 partition (each parameter split on its own, see
``zero3_partition``), the nested optimizer's state, and the partition group's size and rank.

Everything pyckpt reads is checked here, once, when the file is read; the planners index these
records without checking again. Keys pyckpt never reads are left alone (they reach the output
only through ``optimizer_state_dict``, as DeepSpeed copies them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from ..errors import CheckpointFormatError, quoted
from ..formats.pickle_read import Opaque, TensorRef, shared_value
from ..tensors import NewTensor
from ..formats.torch_zip import SourceFile
from ..planning.plan import Piece
from .names import check_param_name
from .schema import Schema, zero_stage


@dataclass(frozen=True, slots=True)
class Fragment:
    """Where one parameter's piece sits in a dp rank's flat partition of a ZeRO-1/2 param group."""

    group: int
    start: int
    numel: int


@dataclass(frozen=True, slots=True)
class Step:
    """The optimizer step as saved: a 0-d tensor (torch >= 1.12 Adam) or a number."""

    file: SourceFile
    value: Any
    # key(), read once: a group's step is compared for each of its parameters
    _key: list = field(default_factory=list, compare=False, repr=False)

    def key(self):
        """A value two steps can be compared by (a tensor's dtype and bytes)."""
        if not isinstance(self.value, TensorRef):
            return self.value
        if not self._key:
            self._key.append((self.value.dtype, self.file.read_bytes(*self.file.tensor_byte_range(self.value))))
        return self._key[0]

    def output(self):
        """The step as a universal ``step.pt`` holds it: a copy of the tensor, or the number."""
        if isinstance(self.value, TensorRef):
            off, nbytes = self.file.tensor_byte_range(self.value)
            return NewTensor(self.value.dtype, self.value.shape, [Piece(self.file, off, nbytes, 0)],
                             self.value.requires_grad)
        return self.value


@dataclass(slots=True)
class FlatGroup:
    """One rank's flat partition of a param group (ZeRO-1/2) or sub-group (ZeRO-3), with its state."""

    index: int
    fp32: TensorRef
    # the torch optimizer's state of this flat tensor as saved (exp_avg, exp_avg_sq, step, ...)
    state: dict
    partition_count: int
    partition_rank: int
    _file: SourceFile = field(default=None, repr=False)
    # one Step per group, so its bytes are read once however many parameters compare it
    _step: Optional[Step] = field(default=None, init=False, repr=False, compare=False)

    def tensor(self, state_name: str) -> Optional[TensorRef]:
        """The flat tensor of one universal state: the fp32 master or an optimizer moment."""
        value = self.fp32 if state_name == "fp32" else self.state.get(state_name)
        return value if isinstance(value, TensorRef) else None

    @property
    def step(self) -> Optional[Step]:
        if self._step is None and "step" in self.state:
            self._step = Step(self._file, self.state["step"])
        return self._step


@dataclass(slots=True)
class ZeroShard:
    file: SourceFile
    stage: int
    dp_rank: int
    # ZeRO-1/2: the groups the optimizer has state for; ZeRO-3: every sub-group
    groups: Tuple[FlatGroup, ...]
    # ZeRO-1/2: param_slice_mappings, one {name: Fragment} per param group
    slice_mappings: Tuple[Dict[str, Fragment], ...]
    # ZeRO-1/2: partition_count per param group (expert groups span fewer ranks than dp)
    partition_counts: Tuple[int, ...]
    # the torch optimizer's param_groups: learning rates, betas, ... by group
    param_groups: list
    # optimizer_state_dict as saved: what zero/optimizer_state.pt is made from
    saved: dict

    @property
    def path(self) -> str:
        return self.file.path


def read_zero_stage(sf: SourceFile) -> int:
    return zero_stage(sf.path, _optimizer_state_dict(sf).get("zero_stage"))


def read_zero_shard(sf: SourceFile, dp_rank: int, dp: int) -> ZeroShard:
    return zero_shard_of(sf, _optimizer_state_dict(sf), dp_rank, dp)


def zero_shard_of(sf: SourceFile, osd: dict, dp_rank: int, dp: int) -> ZeroShard:
    """The record of an ``optimizer_state_dict`` whose tensors live in ``sf``."""
    stage = zero_stage(sf.path, osd.get("zero_stage"))
    return (_read_zero3 if stage == 3 else _read_zero12)(sf, osd, stage, dp_rank, dp)


def _optimizer_state_dict(sf: SourceFile) -> dict:
    obj = sf.load()
    if not isinstance(obj, dict) or "optimizer_state_dict" not in obj:
        raise CheckpointFormatError(f"{sf.path}: no 'optimizer_state_dict' key: not a DeepSpeed ZeRO optimizer shard")
    return Schema(sf.path).dict(obj["optimizer_state_dict"], "optimizer_state_dict")


def _torch_optimizer(s: Schema, value, where: str):
    """A torch optimizer state_dict: {'state': {int: {...}}, 'param_groups': [dict, ...]}."""
    s.dict(value, where)
    state = s.dict(value.get("state"), f"{where}['state']")
    for key, entry in state.items():
        s.int(key, f"{where}['state'] key")
        s.dict(entry, f"{where}['state'][{key}]")
    groups = s.list(value.get("param_groups"), f"{where}['param_groups']")
    for i, group in enumerate(groups):
        s.dict(group, f"{where}['param_groups'][{i}]")
    # the very list object: the ZeRO-3 output holds it twice, and pickle writes it once, by reference
    return state, groups


def _read_zero12(sf: SourceFile, osd: dict, stage: int, dp_rank: int, dp: int) -> ZeroShard:
    s = Schema(sf.path)
    counts = [s.int(c, f"partition_count[{i}]", low=1)
              for i, c in enumerate(s.list(osd.get("partition_count"), "partition_count", optional=True) or [])]
    base = osd.get("base_optimizer_state")
    if not isinstance(base, dict):
        raise CheckpointFormatError(f"{sf.path}: base_optimizer_state is not a dict: elastic checkpoints "
                                    "(zero_optimization.elastic_checkpoint=true) cannot be converted")
    state, param_groups = _torch_optimizer(s, base, "base_optimizer_state")
    for key in ("param_slice_mappings", "single_partition_of_fp32_groups"):
        if key not in osd:
            s.fail(key, "is missing: not a ZeRO-1/2 optimizer shard")
    mappings, owner = [], {}
    for g, mapping in enumerate(s.list(osd["param_slice_mappings"], "param_slice_mappings")):
        where = f"param_slice_mappings[{g}]"
        frags = {}
        for name, frag in s.dict(mapping, where).items():
            check_param_name(name, sf.path, f"{where} key")
            fields = getattr(frag, "_state", None) if isinstance(frag, Opaque) else frag
            if not isinstance(fields, dict):
                s.fail(f"{where}[{quoted(name)}]", "must be a fragment_address with start and numel")
            if name in owner:
                s.fail(where, f"lists {quoted(name)}, which param_slice_mappings[{owner[name]}] lists too")
            owner[name] = g
            # one name object for all the ranks a parameter spans
            frags[shared_value(name)] = Fragment(g, *(s.int(fields.get(f), f"{where}[{quoted(name)}].{f}")
                                                      for f in ("start", "numel")))
        mappings.append(frags)
    fp32 = [s.tensor(t, f"single_partition_of_fp32_groups[{g}]")
            for g, t in enumerate(s.list(osd["single_partition_of_fp32_groups"], "single_partition_of_fp32_groups"))]
    for i, p in enumerate(s.list(osd.get("group_paddings"), "group_paddings", optional=True) or []):
        s.int(p, f"group_paddings[{i}]")
    # torch numbers the state of the flat partitions 0..G-1, one per param group
    groups = []
    for g in range(len(state)):
        if g not in state:
            s.fail("base_optimizer_state['state']", f"has {len(state)} entries but none for group {g}")
        if g >= len(mappings) or g >= len(fp32):
            raise CheckpointFormatError(f"{sf.path}: optimizer state has group {g} but the shard has only "
                                        f"{len(mappings)} slice mappings / {len(fp32)} fp32 partitions")
        groups.append(FlatGroup(g, fp32[g], state[g], counts[g] if g < len(counts) else dp, dp_rank, sf))
    # tuples, the counts shared between ranks: a 4,096-rank plan holds every rank's record
    return ZeroShard(sf, stage, dp_rank, tuple(groups), tuple(mappings), shared_value(tuple(counts)), param_groups,
                     osd)


def _read_zero3(sf: SourceFile, osd: dict, stage: int, dp_rank: int, dp: int) -> ZeroShard:
    s = Schema(sf.path)
    count = osd.get("partition_count")
    if count is not None and not isinstance(count, (list, tuple)):
        s.int(count, "partition_count", low=1)
    flat = [s.tensor(t, f"fp32_flat_groups[{g}]")
            for g, t in enumerate(s.list(osd.get("fp32_flat_groups"), "fp32_flat_groups"))]
    state, param_groups = _torch_optimizer(s, osd.get("optimizer_state_dict"),
                                           "optimizer_state_dict['optimizer_state_dict']")
    parts = s.list(osd.get("ds_zero_partition_groups"), "ds_zero_partition_groups", optional=True) or []
    groups = []
    for i, t in enumerate(flat):
        n, rank = dp, dp_rank
        if i < len(parts):
            where = f"ds_zero_partition_groups[{i}]"
            part = s.dict(parts[i], where)
            if "partition_count" in part:
                n = s.int(part["partition_count"], f"{where}['partition_count']", low=1)
            if "partition_rank" in part:
                rank = s.int(part["partition_rank"], f"{where}['partition_rank']")
                if rank >= n:
                    s.fail(f"{where}['partition_rank']", f"is {rank}, not below partition_count {n}")
        if i not in state:
            raise CheckpointFormatError(f"{sf.path}: optimizer state of sub-group {i} is missing")
        groups.append(FlatGroup(i, t, state[i], n, rank, sf))
    for i in range(len(flat), len(parts)):
        s.dict(parts[i], f"ds_zero_partition_groups[{i}]")
    return ZeroShard(sf, stage, dp_rank, tuple(groups), (), (), param_groups, osd)
