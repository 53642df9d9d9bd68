"""A ZeRO checkpoint as one model state dict, as DeepSpeed's ``zero_to_fp32`` assembles it.

The entries and their order follow ``get_fp32_state_dict_from_zero_checkpoint`` (DeepSpeed 0.19.8):
the persistent buffers of the first model-states file in its ``module`` order, then the frozen
parameters (ZeRO-2: the whole tensors saved in ``frozen_param_fragments``; ZeRO-3: every rank's
fragment concatenated and cut to size; ZeRO-1 saves none), then the trainable parameters in
``param_shapes`` order with their fp32 masters, then tied aliases, each naming the parameter whose
tensor it shares. Nothing is read: every entry is a :class:`NewTensor` of byte pieces.

Trainable parameters come from the Universal Checkpoint plan, so everything the converter handles
(tensor and pipeline parallelism merged by the TP rules, AutoEP experts gathered into full
``[E, ...]`` tensors) consolidates the same way; ``zero_to_fp32`` refuses those inputs. The same
plan's ``fp32.pt`` tensors are what a Universal Checkpoint folder holds, so
:mod:`~pyckpt.universal.read` consolidates one with :func:`assemble` too, taking them from there.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from ..errors import CheckpointFormatError, UnsupportedCheckpointError, quoted
from ..tensors import FLOATING, ITEMSIZE, NewTensor, numel
from ..formats.pickle_read import TensorRef
from ..formats.dtype_cast import cast_bytes
from ..native import CONVERT_TO_F32, KIND_COPY, KIND_SOURCE_DTYPE, cast_kind
from ..planning.plan import Piece
from ..planning.state import FP32, MOMENTS, STEP
from .discovery import ZeroCheckpoint
from .model_states import ModelStates
from .read import read_zero_state



@dataclass
class ConsolidatedState:
    tensors: "OrderedDict[str, NewTensor]" = field(default_factory=OrderedDict)
    # alias -> the entry whose tensor it is (zero_to_fp32 puts the same tensor object under both)
    aliases: "OrderedDict[str, str]" = field(default_factory=OrderedDict)
    buffers: Tuple[str, ...] = ()
    frozen: Tuple[str, ...] = ()
    # name -> {exp_avg, exp_avg_sq, step} as the same read of the optimizer shards found them
    # (consolidate(optimizer=True)); None where they were not asked for
    optimizer_states: Optional[Dict[str, Dict[str, object]]] = None

    def names(self) -> List[str]:
        """Every key of the state dict, in zero_to_fp32's order."""
        return list(self.tensors) + list(self.aliases)


def consolidate(ck: ZeroCheckpoint, exclude_frozen: bool = False, dense_only: bool = False,
                optimizer: bool = False) -> ConsolidatedState:
    """``zero_to_fp32``'s state dict of ``ck``; ``optimizer`` also keeps every trainable parameter's Adam
    moments and step, found by the same read of the optimizer shards (``optimizer_states``)."""
    read: Dict[str, Dict[str, object]] = {}

    def trainable() -> Iterator[Tuple[str, NewTensor]]:
        # An input without universal_checkpoint_info is fine here as for zero_to_fp32, except where the
        # TP merge rules would be guessed.
        state, _ = read_zero_state(ck, inject_missing_state=ck.tp * ck.pp == 1, dense_only=dense_only, strict=False,
                                   states=(FP32, ) + (MOMENTS + (STEP, ) if optimizer else ()))
        read.update(state.params)
        fp32 = {name: held[FP32] for name, held in state.params.items() if FP32 in held}
        for name, shape in trainable_shapes(ck).items():
            obj = fp32.get(name)
            if obj is None:
                continue  # a parameter ZeRO kept no state for (dense_only experts): zero_to_fp32 has none either
            t = obj["param"] if isinstance(obj, dict) else obj
            expert = isinstance(obj, dict) and bool(obj.get("is_expert_param"))
            if ck.tp == 1 and not expert:
                # param_shapes is the full shape here (TP-merged and expert tensors carry their own)
                if t.numel() != numel(shape):
                    raise CheckpointFormatError(f"{ck.folder}: {name} gathers {t.numel()} elements, param_shapes says "
                                                f"{shape}")
                t = NewTensor(t.dtype, shape, t.pieces, t.requires_grad, t.data)  # ZeRO-3 writes flat 1-D tensors
            yield name, t

    out = assemble(ck, trainable, exclude_frozen)
    if optimizer:
        # as a read of the moments and step alone holds them: a parameter none of them was found for is absent
        rest = {name: {k: v for k, v in held.items() if k != FP32} for name, held in read.items()}
        out.optimizer_states = {name: held for name, held in rest.items() if held}
    return out


def assemble(ck, trainable: Callable[[], Iterable[Tuple[str, NewTensor]]], exclude_frozen: bool) -> ConsolidatedState:
    """zero_to_fp32's state dict around the trainable tensors ``trainable()`` yields in param_shapes order.

    Buffers, frozen parameters and tied aliases come from the model-state files, which a ZeRO checkpoint
    and its Universal Checkpoint hold alike; ``ck`` is either (a ZeroCheckpoint, or a UniversalCheckpoint:
    only ``folder``, ``stage``, ``tp``, ``pp``, ``model`` and ``model_grid`` are read). ``trainable`` runs
    after the frozen parameters are checked, so its errors come in zero_to_fp32's order."""
    first = ck.model[0]
    out = ConsolidatedState()
    buffers = set(first.buffer_names)
    for name, t in first.module.items():
        if name in buffers:
            out.tensors[name] = _whole(first, name, t, to_float=t.dtype in FLOATING)
    out.buffers = tuple(out.tensors)
    if not exclude_frozen and first.frozen:
        if ck.tp * ck.pp != 1:
            raise UnsupportedCheckpointError(f"{ck.folder}: frozen parameters under tensor or pipeline parallelism "
                                             "cannot be consolidated yet (pass --exclude_frozen_parameters to leave "
                                             "them out)")
        for name, shape in first.frozen.items():
            out.tensors[name] = (_zero3_frozen(ck, name, shape) if ck.stage == 3
                                 else _zero2_frozen(first, name, shape))
        out.frozen = tuple(first.frozen)
    for name, t in trainable():
        if name in out.tensors:
            raise CheckpointFormatError(f"{first.path}: {name} is both a buffer or frozen parameter and trainable")
        out.tensors[name] = t
    for alias, holder in first.shared_params.items():
        if holder in out.tensors and alias not in out.tensors:
            out.aliases[alias] = holder
    return out


def trainable_shapes(ck) -> "OrderedDict[str, tuple]":
    """param_shapes in DeepSpeed's union order over model-parallel ranks (first seen first)."""
    shapes: "OrderedDict[str, tuple]" = OrderedDict()
    for ms in ck.model:
        for name, shape in ms.shapes.items():
            shapes.setdefault(name, shape)
    return shapes


def _whole(ms: ModelStates, name: str, t: TensorRef, to_float: bool) -> NewTensor:
    """A saved tensor as it is (``to_float``: as ``.float()`` makes it, the kinds doing the cast)."""
    off, nbytes = ms.file.tensor_byte_range(t)
    kind = CONVERT_TO_F32[t.dtype] if to_float else KIND_COPY
    pieces = [Piece(ms.file, off, nbytes, 0, kind)] if nbytes else []
    return NewTensor("float32" if to_float else t.dtype, tuple(t.shape), pieces)


def _zero2_frozen(ms: ModelStates, name: str, shape: tuple) -> NewTensor:
    t = ms.frozen_fragments.get(name)
    if t is None:
        raise CheckpointFormatError(f"{ms.path}: frozen parameter {name} has no tensor in frozen_param_fragments")
    if t.numel() != numel(shape):
        raise CheckpointFormatError(f"{ms.path}: frozen_param_fragments[{quoted(name)}] holds {t.numel()} elements, "
                                    f"frozen_param_shapes says {shape}")
    whole = _whole(ms, name, t, to_float=False)
    return NewTensor(whole.dtype, shape, whole.pieces)


def _zero3_frozen(ck: ZeroCheckpoint, name: str, shape: tuple) -> NewTensor:
    """Every dp rank's partition in order, cut to the parameter's size (zero_to_fp32's cat + narrow)."""
    want = numel(shape)
    pieces: List[Piece] = []
    dtype, at = None, 0
    for ms in ck.model_grid[0]:
        t = ms.frozen_fragments.get(name)
        if t is None:
            raise CheckpointFormatError(f"{ms.path}: frozen parameter {name} has no fragment in frozen_param_fragments")
        if dtype not in (None, t.dtype):
            raise CheckpointFormatError(f"{ms.path}: frozen fragment of {name} is {t.dtype}, another rank's {dtype}")
        dtype = t.dtype
        take = min(t.numel(), want - at // ITEMSIZE[dtype])
        if take > 0:
            off, nbytes = ms.file.tensor_byte_range(t, 0, take)
            pieces.append(Piece(ms.file, off, nbytes, at))
            at += nbytes
    if dtype is None or at != want * ITEMSIZE[dtype]:
        raise CheckpointFormatError(f"{ck.folder}: the frozen fragments of {name} hold fewer than the {want} elements "
                                    "of its frozen_param_shapes entry")
    return NewTensor(dtype, shape, pieces)


def cast(t: NewTensor, dtype: str) -> NewTensor:
    """``t`` as ``Tensor.to(dtype)`` makes it, by changing its pieces' conversions (no bytes read)."""
    if t.dtype == dtype:
        return t
    if t.data is not None:
        return NewTensor(dtype, t.shape, [], t.requires_grad, cast_bytes(t.data, t.dtype, dtype))
    out_size, in_size = ITEMSIZE[dtype], ITEMSIZE[t.dtype]
    pieces = []
    for p in t.pieces:
        src_dtype = t.dtype if p.kind == KIND_COPY else KIND_SOURCE_DTYPE[p.kind]
        kind = cast_kind(src_dtype, dtype) if p.src is not None else KIND_COPY
        if kind is None:
            raise UnsupportedCheckpointError(f"{p.src.path}: cannot cast {src_dtype} to {dtype}")
        nbytes = p.nbytes if p.src is not None else p.nbytes // in_size * out_size
        pieces.append(Piece(p.src, p.src_off, nbytes, p.dst_off // in_size * out_size, kind, p.rows,
                            p.stride // in_size * out_size))
    return NewTensor(dtype, t.shape, pieces, t.requires_grad)
