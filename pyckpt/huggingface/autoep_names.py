"""AutoEP layers back under the Hugging Face module names they replaced, for ``from_pretrained``.

AutoEP swaps each MoE block's router and experts for its own layer: the router weight becomes
``<block>.router.gate.weight`` and the experts ``<block>.experts.w1/w2/w3`` (gate, down, up; each
``[E, ...]``). DeepSpeed 0.19.8's Mixtral preset (``module_inject/auto_ep_presets/mixtral.py``)
records the Hugging Face side: the router is ``<block>.gate`` and the experts are fused 3-D
tensors, ``gate_up_proj`` ``[E, 2*ffn, hidden]`` and ``down_proj`` ``[E, hidden, ffn]``; its
repacking (``moe/ep_repack.py::_repack_fused_3d``, layout "gate_up_first") takes w1 as the first
``ffn`` rows of each expert's ``gate_up_proj`` and w3 as the rest, and w2 as ``down_proj``. This
module inverts that as byte pieces: each expert's ``gate_up_proj`` is its w1 rows then its w3 rows,
nothing computed. The checkpoint does not name its preset; the model config beside it does
(``model_type``). Presets whose blocks keep more (shared experts, router biases) are not mapped.
"""

from __future__ import annotations

import reprlib
from collections import OrderedDict
from typing import Dict, List, Optional

from ..errors import CheckpointFormatError, UnsupportedCheckpointError, quoted
from ..tensors import ITEMSIZE, NewTensor
from ..native import KIND_COPY, KIND_SOURCE_DTYPE
from ..planning.plan import Piece

# model_type -> (router attribute, experts attribute) of the presets mapped here: fused 3-D
# experts with gate and up in one tensor, no gate bias, no shared experts.
PRESETS = {"mixtral": ("gate", "experts")}


def preset_of(config: Optional[dict]) -> Optional[tuple]:
    model_type = (config or {}).get("model_type")
    return PRESETS.get(model_type) if isinstance(model_type, str) else None


def hf_renames(layers: List[dict], preset: tuple) -> Dict[str, Optional[str]]:
    """AutoEP name -> the Hugging Face name that holds it (None for w3, which gate_up_proj holds
    after w1): the names a param group or a per-parameter state moves to."""
    router, experts = preset
    out: Dict[str, Optional[str]] = {}
    for layer in layers:
        block, prefix = layer["module_path"], layer["expert_key_prefix"]
        out[f"{block}.router.gate.weight"] = f"{block}.{router}.weight"
        out[f"{prefix}.w1"] = f"{block}.{experts}.gate_up_proj"
        out[f"{prefix}.w2"] = f"{block}.{experts}.down_proj"
        out[f"{prefix}.w3"] = None
    return out


def to_hf_names(tensors: "OrderedDict[str, NewTensor]", layers: List[dict], preset: tuple,
                where: str) -> "OrderedDict[str, NewTensor]":
    """``tensors`` with every AutoEP layer's router and experts under the preset's names, in place of
    the AutoEP ones (the other entries keep their order)."""
    router, experts = preset
    renamed: Dict[str, tuple] = {}  # AutoEP name -> (HF name, tensor) at the position of the first
    for layer in layers:
        block = layer["module_path"]
        prefix = layer["expert_key_prefix"]
        names = {k: f"{prefix}.{k}" for k in ("w1", "w2", "w3")}
        missing = [n for n in names.values() if n not in tensors]
        if missing:
            raise UnsupportedCheckpointError(f"{where}: AutoEP layer {block} has no {missing[0]} to export")
        extra = [n for n in tensors if n.startswith(block + ".") and n not in names.values()
                 and n != f"{block}.router.gate.weight"]
        if extra:
            raise UnsupportedCheckpointError(f"{where}: AutoEP layer {block} holds {extra[0]}, which the "
                                             f"Hugging Face {router}/{experts} layout has no place for")
        gate = f"{block}.router.gate.weight"
        if gate not in tensors:
            raise UnsupportedCheckpointError(f"{where}: AutoEP layer {block} has no router weight {gate}")
        renamed[gate] = (f"{block}.{router}.weight", tensors[gate])
        w1, w2, w3 = (tensors[names[k]] for k in ("w1", "w2", "w3"))
        renamed[names["w1"]] = (f"{block}.{experts}.gate_up_proj", _gate_up(w1, w3, where, block))
        renamed[names["w2"]] = (f"{block}.{experts}.down_proj", w2)
        renamed[names["w3"]] = None  # folded into gate_up_proj
    out: "OrderedDict[str, NewTensor]" = OrderedDict()
    for name, t in tensors.items():
        if name not in renamed:
            out[name] = t
        elif renamed[name] is not None:
            hf_name, hf_tensor = renamed[name]
            if hf_name in tensors or hf_name in out:
                raise UnsupportedCheckpointError(f"{where}: {hf_name} exists beside AutoEP layer {name}")
            out[hf_name] = hf_tensor
    return out


def _gate_up(w1: NewTensor, w3: NewTensor, where: str, block: str) -> NewTensor:
    """``[E, 2*ffn, hidden]``: per expert, its w1 rows then its w3 rows."""
    if (w1.dtype != w3.dtype or len(w1.shape) != 3 or tuple(w1.shape) != tuple(w3.shape)
            or w1.data is not None or w3.data is not None):
        raise UnsupportedCheckpointError(f"{where}: AutoEP layer {block}: w1 {list(w1.shape)} and w3 "
                                         f"{list(w3.shape)} do not make one gate_up_proj")
    experts, ffn, hidden = w1.shape
    block_bytes = ffn * hidden * ITEMSIZE[w1.dtype]
    pieces = (_regroup(w1, block_bytes, 0, where, block) + _regroup(w3, block_bytes, block_bytes, where, block))
    return NewTensor(w1.dtype, (experts, 2 * ffn, hidden), pieces, w1.requires_grad or w3.requires_grad)


def _regroup(t: NewTensor, block: int, shift: int, where: str, layer: str) -> List[Piece]:
    """``t``'s pieces placed so that its expert e (bytes [e*block, (e+1)*block)) lands at
    2*e*block + shift: contiguous pieces are split at expert boundaries, strided ones must stay
    inside one expert."""
    out_item = ITEMSIZE[t.dtype]
    out: List[Piece] = []
    for p in t.pieces:
        in_item = out_item if p.kind == KIND_COPY or p.src is None else ITEMSIZE[KIND_SOURCE_DTYPE[p.kind]]
        src_row = p.nbytes // p.rows if p.src is not None else p.nbytes // p.rows // out_item * in_item
        dst_row = src_row // in_item * out_item
        if p.rows == 1:
            done = 0
            while done < dst_row:
                at = p.dst_off + done
                expert, within = divmod(at, block)
                n = min(dst_row - done, block - within)
                src_n = n // out_item * in_item
                nbytes = src_n if p.src is not None else n
                out.append(Piece(p.src, p.src_off + done // out_item * in_item, nbytes,
                                 2 * expert * block + shift + within, p.kind))
                done += n
            continue
        first, last = p.dst_off, p.dst_off + (p.rows - 1) * p.stride + dst_row - 1
        if first // block != last // block:
            raise UnsupportedCheckpointError(f"{where}: AutoEP layer {layer}: a strided copy spans two experts")
        expert = first // block
        out.append(Piece(p.src, p.src_off, p.nbytes, p.dst_off + expert * block + shift, p.kind, p.rows, p.stride))
    return out


def autoep_naming(ck, state, config: Optional[dict], notes: list, required: bool = False) -> Optional[tuple]:
    """(AutoEP layers, preset) when the checkpoint's AutoEP layers go back under the Hugging Face
    names of the model type the config beside it names (``deepspeed.autoep.hf_names``); None when it
    has no AutoEP layer or no mapping is known (``notes`` says which), an error naming why when the
    caller ``required`` the names (the DCP export's ``--hf-names``)."""
    def unnamed(why: str):
        if required:
            raise UnsupportedCheckpointError(f"{ck.folder}: --hf-names asks for the AutoEP layers under their Hugging "
                                             f"Face names, but {why}")
        return None

    layers = next((ms.autoep_layers for ms in ck.model if ms.autoep_layers is not None), None)
    if not layers:
        return unnamed("it has no AutoEP layer")
    for entry in layers:
        if not (isinstance(entry, dict) and isinstance(entry.get("module_path"), str)
                and isinstance(entry.get("expert_key_prefix"), str)):
            raise CheckpointFormatError(f"{ck.model[0].path}: an ds_autoep_layers entry lacks its module_path or "
                                        "expert_key_prefix")
    preset = preset_of(config)
    if preset is None:
        kind = (config or {}).get("model_type")
        why = ("no config.json beside the checkpoint" if config is None
               else f"model_type {reprlib.repr(kind)} has no mapping")
        notes.append(f"  AutoEP layers kept under their AutoEP names (router.gate, experts.w1/w2/w3): {why}")
        return unnamed(why)
    renamed = set(state.aliases.values()) & {name for e in layers for name in state.tensors
                                             if name.startswith(e["module_path"] + ".")}
    if renamed:
        raise UnsupportedCheckpointError(f"{ck.folder}: {sorted(renamed)[0]} is both an AutoEP weight and shared "
                                         "with another parameter")
    notes.append(f"  AutoEP layers under the Hugging Face names of model_type {quoted(config['model_type'])} "
                 f"({preset[0]}, {preset[1]}.gate_up_proj, {preset[1]}.down_proj)")
    return layers, preset
