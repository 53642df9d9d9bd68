"""A Hugging Face Llama's training state under torchtitan's own names, for a torchtitan job to resume.

torchtitan (0.3.0) trains its own Llama3 module, whose names and layouts differ from the Hugging
Face model a DeepSpeed job trains. Its state-dict adapter (``models/llama3/state_dict_adapter.py``,
``from_hf``) renames (``model.embed_tokens`` -> ``tok_embeddings``, ``self_attn.q_proj`` ->
``attention.qkv_linear.wq``, ``mlp.gate_proj``/``up_proj``/``down_proj`` -> ``feed_forward.w1``/
``w3``/``w2``, the two norms -> ``attention_norm``/``ffn_norm``) and permutes the rows of every q
and k projection: Hugging Face's rotary embedding rotates the two halves of a head, torchtitan's
rotates adjacent pairs, so within a head of ``hd`` rows, torchtitan's row ``2*i + c`` is Hugging
Face's row ``c*hd/2 + i`` (``_reverse_permute``).

The model's state dict keeps q, k and v apart (a save hook splits them), but the parameter the
optimizer holds is one fused ``attention.qkv_linear.wqkv.weight``: for each key/value head ``g``,
the rows of its ``heads/kv_heads`` query heads, then its key head, then its value head
(``attention.py``, ``_merge_qkv_on_load``). torchtitan's checkpointer keys the optimizer state by
that parameter, so the Adam moments of q, k and v become one tensor there, and q, k and v must
share a param group and a step.

Everything here is byte pieces: a permuted or fused tensor is the same source ranges placed at
other rows, nothing read or computed.
"""

from __future__ import annotations

import os
import re
import reprlib
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

from ..errors import CheckpointFormatError, UnsupportedCheckpointError
from ..native import KIND_COPY
from ..planning.plan import Piece, Segments, row_pieces
from ..tensors import ITEMSIZE, NewTensor

MODEL_TYPES = ("llama",)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\Z")
# Hugging Face name inside a layer -> torchtitan's, as the adapter's from_hf map has them
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attention.qkv_linear.wq.weight",
    "self_attn.k_proj.weight": "attention.qkv_linear.wk.weight",
    "self_attn.v_proj.weight": "attention.qkv_linear.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_TOP_NAMES = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "lm_head.weight"}
FUSED = "attention.qkv_linear.wqkv.weight"


# No model has attention anywhere near this wide; a bound keeps a hostile config's number from
# becoming a row count (a head of 10**18 rows) before a shape check sees it.
MAX_ATTENTION_SIZE = 1 << 20


def _shape_value(config: dict, key: str, config_path: str, default: Optional[int] = None) -> int:
    """``config[key]`` as an attention size: a JSON integer in [1, MAX_ATTENTION_SIZE]; ``default``
    where the key is absent or null (transformers fills those from the other sizes)."""
    value = config.get(key)
    if value is None and default is not None:
        return default
    if type(value) is not int or not 1 <= value <= MAX_ATTENTION_SIZE:
        found = reprlib.repr(value) if key in config else "missing"
        raise CheckpointFormatError(f"{config_path}: {key} is {found}; the attention shape needs a positive integer "
                                    f"of at most {MAX_ATTENTION_SIZE}")
    return value


class Heads:
    """The attention shape the permutation and the fusion need, from the model's config (read from
    ``config_path``, beside the checkpoint folder ``where``)."""

    def __init__(self, config: Optional[dict], where: str, config_path: Optional[str] = None):
        config_path = config_path or os.path.join(where, "config.json")
        model_type = (config or {}).get("model_type")
        if model_type not in MODEL_TYPES:
            found = "no config.json beside it" if config is None else f"model_type {reprlib.repr(model_type)}"
            raise UnsupportedCheckpointError(f"{where}: torchtitan names are known for {', '.join(MODEL_TYPES)} "
                                             f"models; the checkpoint has {found}")
        self.heads = _shape_value(config, "num_attention_heads", config_path)
        self.kv_heads = _shape_value(config, "num_key_value_heads", config_path, self.heads)
        hidden = _shape_value(config, "hidden_size", config_path)
        self.head_dim = _shape_value(config, "head_dim", config_path, hidden // self.heads)
        if self.heads % self.kv_heads or self.head_dim % 2 or self.head_dim < 1:
            raise UnsupportedCheckpointError(f"{config_path}: the attention shape ({self.heads} heads, "
                                             f"{self.kv_heads} key/value heads of {self.head_dim}) is not one "
                                             "torchtitan's Llama3 builds")
        self.where = where


def torchtitan_name(name: str, where: str) -> str:
    """torchtitan's name of one Hugging Face Llama parameter (or refusal, naming it)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _LAYER.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise UnsupportedCheckpointError(f"{where}: {name} has no torchtitan Llama3 name (torchtitan's adapter maps "
                                     "embeddings, attention, MLP, norms and lm_head only)")


def optimizer_name(name: str, where: str) -> Optional[str]:
    """The torchtitan parameter that holds ``name`` for the optimizer: q, k and v all go to the fused
    ``wqkv`` (q names it, k and v give None: their state is inside q's)."""
    tt = torchtitan_name(name, where)
    for part, fused in ((".wq.weight", True), (".wk.weight", False), (".wv.weight", False)):
        if tt.endswith(".qkv_linear" + part):
            return tt[:-len("attention.qkv_linear" + part)] + FUSED if fused else None
    return tt


def _kv_of(q_name: str) -> Tuple[str, str]:
    """The Hugging Face k and v projections fused with the q projection ``q_name``."""
    return q_name.replace(".q_proj.", ".k_proj."), q_name.replace(".q_proj.", ".v_proj.")


def _q_of(member: str) -> str:
    """The q projection a k or v projection is fused with."""
    return member.replace(".k_proj.", ".q_proj.").replace(".v_proj.", ".q_proj.")


def to_torchtitan_model(tensors: "OrderedDict[str, NewTensor]", heads: Heads) -> "OrderedDict[str, NewTensor]":
    """The model's entries as torchtitan's state dict has them: renamed, q and k rows permuted."""
    out: "OrderedDict[str, NewTensor]" = OrderedDict()
    for name, t in tensors.items():
        tt = torchtitan_name(name, heads.where)
        if tt.endswith(".wq.weight"):
            t = _permuted(name, t, heads.heads, heads)
        elif tt.endswith(".wk.weight"):
            t = _permuted(name, t, heads.kv_heads, heads)
        out[tt] = t
    return out


def to_torchtitan_optimizer(tensors: "OrderedDict[str, NewTensor]", heads: Heads) -> "OrderedDict[str, NewTensor]":
    """One Adam moment of every parameter keyed as torchtitan's optimizer holds it: q, k and v fused
    into ``wqkv`` (at q's place), the others renamed."""
    out: "OrderedDict[str, NewTensor]" = OrderedDict()
    for name, t in tensors.items():
        fused = optimizer_name(name, heads.where)
        if fused is None:
            continue
        if fused.endswith(FUSED):
            kv = _kv_of(name)
            missing = [n for n in kv if n not in tensors]
            if missing:
                raise UnsupportedCheckpointError(f"{heads.where}: {missing[0]} is missing, so {name} cannot become "
                                                 "torchtitan's fused wqkv")
            t = _fused_qkv((name, *kv), (t, *(tensors[n] for n in kv)), heads)
        out[fused] = t
    orphans = [n for n in tensors if optimizer_name(n, heads.where) is None and _q_of(n) not in tensors]
    if orphans:
        raise UnsupportedCheckpointError(f"{heads.where}: {orphans[0]} has no q_proj beside it to fuse with")
    return out


def _segments(name: str, t: NewTensor, where: str) -> Segments:
    """``t``'s bytes as source ranges in order: the tensor must be plain copies that tile it."""
    if t.data is not None or any(p.src is None or p.kind != KIND_COPY for p in t.pieces):
        raise UnsupportedCheckpointError(f"{where}: {name} is not assembled from plain copies (a conversion), which "
                                         "torchtitan's row order cannot be laid over")
    # a strided piece (a column block of a tensor-parallel shard) is its rows, each a range of its own
    flat = [Piece(p.src, p.src_off + r * p.nbytes, p.nbytes, p.dst_off + r * p.stride) for p in t.pieces
            for r in range(p.rows)]
    seg, at = Segments(), 0
    for p in sorted(flat, key=lambda p: p.dst_off):
        if p.dst_off != at:
            raise UnsupportedCheckpointError(f"{where}: the pieces of {name} do not tile it (a gap at byte {at})")
        seg.append(p.src, p.src_off, p.nbytes)
        at += p.nbytes
    if at != t.numel() * ITEMSIZE[t.dtype]:
        raise UnsupportedCheckpointError(f"{where}: the pieces of {name} cover {at} of its "
                                         f"{t.numel() * ITEMSIZE[t.dtype]} bytes")
    return seg


def _rows(name: str, t: NewTensor, count: int, heads: Heads) -> int:
    if len(t.shape) != 2 or t.shape[0] != count * heads.head_dim:
        raise UnsupportedCheckpointError(f"{heads.where}: {name} is {list(t.shape)}, not {count} heads of "
                                         f"{heads.head_dim} rows as config.json says")
    return t.shape[1] * ITEMSIZE[t.dtype]


def _head(seg: Segments, head: int, row: int, hd: int, dst_row: int, permute: bool) -> List[Piece]:
    """Head ``head`` of ``seg`` (rows of ``row`` bytes) placed at destination row ``dst_row``, its rows
    in torchtitan's rotary order when ``permute``: the rows of each half land on every other row."""
    base = head * hd * row
    if not permute:
        return row_pieces(seg.slice(base, hd * row), hd, row, 0, row, dst_row * row, row)
    half = hd // 2
    return [p for c in (0, 1)
            for p in row_pieces(seg.slice(base + c * half * row, half * row), half, row, 0, 2 * row,
                                (dst_row + c) * row, row)]


def _permuted(name: str, t: NewTensor, count: int, heads: Heads) -> NewTensor:
    row = _rows(name, t, count, heads)
    seg = _segments(name, t, heads.where)
    hd = heads.head_dim
    pieces = [p for h in range(count) for p in _head(seg, h, row, hd, h * hd, True)]
    return NewTensor(t.dtype, tuple(t.shape), pieces, t.requires_grad)


def _fused_qkv(names: Tuple[str, str, str], qkv: Tuple[NewTensor, NewTensor, NewTensor], heads: Heads) -> NewTensor:
    """``wqkv``: per key/value head g, its query heads (permuted), its key head (permuted), its value head."""
    q, k, v = qkv
    row = _rows(names[0], q, heads.heads, heads)
    for n, t in zip(names[1:], (k, v)):
        if _rows(n, t, heads.kv_heads, heads) != row or t.dtype != q.dtype:
            raise UnsupportedCheckpointError(f"{heads.where}: {n} does not fuse with {names[0]} (its rows' size "
                                             "or dtype differ)")
    qs, ks, vs = (_segments(n, t, heads.where) for n, t in zip(names, qkv))
    hd, per = heads.head_dim, heads.heads // heads.kv_heads
    pieces: List[Piece] = []
    at = 0  # destination head slot
    for g in range(heads.kv_heads):
        for r in range(per):
            pieces += _head(qs, g * per + r, row, hd, at * hd, True)
            at += 1
        pieces += _head(ks, g, row, hd, at * hd, True)
        pieces += _head(vs, g, row, hd, (at + 1) * hd, False)
        at += 2
    rows = (heads.heads + 2 * heads.kv_heads) * hd
    return NewTensor(q.dtype, (rows, q.shape[1]), pieces, q.requires_grad or k.requires_grad or v.requires_grad)


_FROM_TOP = {tt: hf for hf, tt in _TOP_NAMES.items()}
_FROM_LAYER = {tt: hf for hf, tt in _LAYER_NAMES.items()}
_TT_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\Z")


def hf_name(name: str, where: str) -> str:
    """The Hugging Face Llama name of one torchtitan Llama3 parameter (the inverse of
    :func:`torchtitan_name`), or refusal naming it."""
    if name in _FROM_TOP:
        return _FROM_TOP[name]
    m = _TT_LAYER.match(name)
    if m and m.group(2) in _FROM_LAYER:
        return f"model.layers.{m.group(1)}.{_FROM_LAYER[m.group(2)]}"
    raise UnsupportedCheckpointError(f"{where}: {name} is not a torchtitan Llama3 parameter pyckpt maps to a Hugging "
                                     "Face name (embeddings, attention, MLP, norms and lm_head)")


def from_torchtitan_model(tensors: "OrderedDict[str, NewTensor]", heads: Heads) -> "OrderedDict[str, NewTensor]":
    """A torchtitan Llama3 state dict's entries under the Hugging Face names, q and k rows back in Hugging
    Face's rotary order (what torchtitan's adapter ``to_hf`` gives)."""
    out: "OrderedDict[str, NewTensor]" = OrderedDict()
    for name, t in tensors.items():
        hf = hf_name(name, heads.where)
        if name.endswith(".qkv_linear.wq.weight"):
            t = _unpermuted(name, t, heads.heads, heads)
        elif name.endswith(".qkv_linear.wk.weight"):
            t = _unpermuted(name, t, heads.kv_heads, heads)
        if hf in out:
            raise CheckpointFormatError(f"{heads.where}: two entries map to {hf}")
        out[hf] = t
    return out


def _unpermuted(name: str, t: NewTensor, count: int, heads: Heads) -> NewTensor:
    """The inverse of :func:`_permuted`: torchtitan's row ``2*i + c`` of a head back to row ``c*hd/2 + i``."""
    row = _rows(name, t, count, heads)
    seg = _segments(name, t, heads.where)
    hd = heads.head_dim
    half = hd // 2
    pieces = [p for h in range(count) for c in (0, 1)
              for p in row_pieces(seg.slice(h * hd * row, hd * row), half, 2 * row, c * row, row,
                                  (h * hd + c * half) * row, row)]
    return NewTensor(t.dtype, tuple(t.shape), pieces, t.requires_grad)


def optimizer_renames(names, where: str) -> Dict[str, Optional[str]]:
    """Every parameter name -> the torchtitan parameter its param group membership and step move to
    (None for k and v, which the fused wqkv's q entry stands for)."""
    return {n: optimizer_name(n, where) for n in names}


def fused_members(names, where: str) -> List[Tuple[str, str, str]]:
    """(q, k, v) Hugging Face names of each fused wqkv: they must share one group and one step."""
    return [(n, *_kv_of(n)) for n in names if (optimizer_name(n, where) or "").endswith(FUSED)]
