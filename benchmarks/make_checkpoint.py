"""Synthetic DeepSpeed ZeRO checkpoints at benchmark scale, written in seconds.

    python benchmarks/make_checkpoint.py OUT --params 1B --dp 64 --stage 2 [--dtype fp32|bf16]
        [--layers N] [--hidden H] [--experts 64 --ep 8 --moe-layers 2] [--sub-group-size N] [--tp N]
        [--family toy|llama|mixtral|deepseek [--heads N] [--kv-heads N] [--dense-layers N] [--vocab N]]

A real save at dp 64 needs 64 ranks holding the whole model; this writes the files
DeepSpeed 0.19.8's ``save_checkpoint`` would write for the same model and topology (tp = pp = 1,
torch Adam after one step, ``client_state={'universal_checkpoint_info': {}}``), with the same
pickled structure (key order, object types, storage sharing), so both ``ds_to_universal.py`` and
pyckpt accept them. Only the tensor values are made up.

Values cost nothing: one noise file of random float32 in [-1, 1] (any 4-byte-aligned window is a
finite float), non-negative float32 for ``exp_avg_sq``, random bf16, zeros for padding and the
Adam step. Every tensor is a list of byte ranges of that file (wrapping around its regions, whose
lengths are primes so that wraps never line up), and pyckpt's native executor copies them into
the archives. A parameter's state is one contiguous window of the noise in its flat group, split
exactly as ZeRO splits the group, so a converter that takes a fragment from the wrong offset or
rank produces visibly different values. No tensor is built in memory: the generator stays near
100 MB of RSS at any size (most of it the noise file's pages), ~200 MB for ZeRO-3 at dp 4096.

The layouts this reproduces (as DeepSpeed 0.19.8's engine and ZeRO optimizers save them):
* ZeRO-1/2: ``mp_rank_00_model_states.pt`` (module = views of the padded bit16 flat group) and one
  optimizer shard per dp rank: flat groups padded to ``2*W``, partition ``P = N_pad/W``,
  ``single_partition_of_fp32_groups`` with padding stripped (a view of the P-long storage),
  moments of length P, ``param_slice_mappings`` of the params overlapping the partition.
* ZeRO-3: per dp rank a model-state file (0-numel placeholders) and a shard whose sub-groups hold
  ``ceil(n/W)`` elements per param (``fp32_flat_groups`` tagged with ``ds_id``).
* AutoEP (Mixtral-like ``model.layers.{i}.mlp.experts.w1/w2/w3``): a second param group
  ``ep_size_{ep}`` partitioned over the expert-data-parallel group, ``ds_autoep_layers``, and
  per-expert files (ZeRO-1/2) or the partition-native layout (ZeRO-3).

Parameter layouts: the default toy stacks (few, odd-shaped tensors), or with ``--family`` a real
model's names and tensor count at any width: ``llama`` (LlamaForCausalLM: 9 per layer + 3, so 723 at
80 layers; with ``--tp``, cut and described as DeepSpeed AutoTP does), ``mixtral`` and ``deepseek``
(DeepSeek-V3: MLA attention, 3 dense layers, then routed + shared experts) as DeepSpeed AutoEP
leaves them. ``--hidden 8`` keeps metadata-heavy checkpoints (thousands of ranks or expert files)
small on disk. Planning costs O(what each file holds): no rank rescans the model, and archives go
to the executor in batches, so memory stays flat in dp.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import importlib.util
import math
import os
import re
import shutil
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from pyckpt.execution.executor import execute
from pyckpt.planning.plan import Piece, Plan
from pyckpt.formats.pickle_read import Opaque, OpaqueEnum, TensorRef, TorchSize
from pyckpt.formats.pickle_write import NewTensor

DS_VERSION = "0.19.8"
GLOBAL_STEPS = 1
MICRO_BATCH = 1
LR = 1e-2
HEAD_ROWS = 7  # the dense model's output head: an odd row count keeps the flat groups unaligned
VOCAB = 11  # the AutoEP model's embedding / lm_head rows (as the harness's TinyMoE)
VOCAB_TP = 37  # the TP model's vocabulary before padding to a multiple of tp (3 padded rows are stripped)
WEIGHTS = ("w1", "w2", "w3")
# Realistic layouts (--family): Hugging Face names, as the models are built for training under DeepSpeed.
FAMILIES = ("toy", "llama", "mixtral", "deepseek")
FAMILY_VOCAB = {"llama": 128256, "mixtral": 32000, "deepseek": 129280}  # Llama 3, Mixtral 8x7B, DeepSeek-V3
FAMILY_EXPERTS = {"mixtral": 8, "deepseek": 256}
AUTOEP_PRESET = {"toy": "mixtral", "mixtral": "mixtral", "deepseek": "deepseek_v3"}

# ----------------------------------------------------------------------------------------------
# DeepSpeed objects, written under their global names without importing DeepSpeed
# ----------------------------------------------------------------------------------------------

_CLASSES: Dict[Tuple[str, str], type] = {}


def _opaque_class(module: str, name: str, enum: bool = False) -> type:
    cls = _CLASSES.get((module, name))
    if cls is None:
        cls = type(name, (OpaqueEnum if enum else Opaque, ), {"_global": (module, name)})
        _CLASSES[(module, name)] = cls
    return cls


def _newobj(module: str, name: str, state: dict) -> Opaque:
    # torch.save writes these plain classes as NEWOBJ + BUILD: __new__ without __init__.
    cls = _opaque_class(module, name)
    obj = Opaque.__new__(cls)
    obj.__setstate__(state)
    return obj


def loss_scaler() -> Opaque:
    return _newobj("deepspeed.runtime.fp16.loss_scaler", "LossScaler", {"cur_scale": 1.0, "dynamic": False})


def fragment_address(numel: int, start: int) -> Opaque:
    return _newobj("deepspeed.utils.tensor_fragment", "fragment_address", {"numel": numel, "start": start})


def zero_stage_enum(stage: int) -> Opaque:
    # Enum members pickle as REDUCE of Cls(value), which is what calling the class records.
    return _opaque_class("deepspeed.runtime.zero.config", "ZeroStageEnum", enum=True)(stage)


def adam_param_group(params: List[int], name: Optional[str] = None, moe: bool = False) -> dict:
    """torch.optim.Adam's param_group keys in torch 2.13 order; AutoEP puts name/moe first."""
    group = {}
    if name is not None:
        group["name"] = name
    if moe:
        group["moe"] = True
    group.update({"lr": LR, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0, "amsgrad": False,
                  "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                  "decoupled_weight_decay": False, "params": params})
    return group


# ----------------------------------------------------------------------------------------------
# The noise file and views of it
# ----------------------------------------------------------------------------------------------


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def _prime_at_least(n: int) -> int:
    while not _is_prime(n):
        n += 1
    return n


class Region:
    """Elements of one dtype in the noise file; positions wrap around its (prime) length."""

    def __init__(self, source, offset: int, length: int, itemsize: int):
        self.source, self.offset, self.length, self.itemsize = source, offset, length, itemsize

    def ranges(self, start: int, count: int):
        start %= self.length
        while count > 0:
            take = min(count, self.length - start)
            yield self.source, self.offset + start * self.itemsize, take * self.itemsize
            count -= take
            start = 0


class Noise:
    """The source file of every tensor byte; Piece.src only needs ``.path``."""

    # Region sizes in elements, rounded up to primes: ~64 MiB in all, written in well under a second.
    F32, NONNEG, BF16, ZERO_BYTES = 8 << 20, 4 << 20, 8 << 20, 1 << 16

    def __init__(self, path: str, seed: int):
        self.path = path
        rng = np.random.default_rng(seed)
        nf, ns, nb = (_prime_at_least(n) for n in (self.F32, self.NONNEG, self.BF16))

        def signed(n):
            # float32 straight from the generator: no float64 temporaries
            return rng.random(n, dtype=np.float32) * np.float32(2) - np.float32(1)

        regions = [
            lambda: signed(nf),
            # Adam's second moment is a running mean of squared gradients: small and never negative.
            lambda: rng.random(ns, dtype=np.float32) * np.float32(1e-3),
            # bf16 is the upper half of a float32; truncating finite values in [-1, 1] stays finite.
            lambda: (signed(nb).view(np.uint32) >> 16).astype(np.uint16),
            lambda: np.zeros(self.ZERO_BYTES, np.uint8),
            lambda: np.array([float(GLOBAL_STEPS)], dtype=np.float32),
        ]
        offsets = [0]
        with open(path, "wb") as f:
            for make in regions:  # one region in memory at a time
                arr = make()
                f.write(memoryview(arr).cast("B"))
                offsets.append(offsets[-1] + arr.nbytes)
                del arr
        self.f32 = Region(self, offsets[0], nf, 4)
        self.nonneg = Region(self, offsets[1], ns, 4)
        self.bf16 = Region(self, offsets[2], nb, 2)
        self.zero = Region(self, offsets[3], self.ZERO_BYTES, 1)
        self.step_offset = offsets[4]


class Flat:
    """A byte string being assembled from noise ranges (one storage record)."""

    def __init__(self):
        self.pieces: List[Piece] = []
        self.nbytes = 0

    def add(self, region: Region, start: int, count: int) -> "Flat":
        if count <= 0:
            return self
        start %= region.length
        if 0 < count <= region.length - start:  # no wrap: the common case, without the generator
            return self._append(region.source, region.offset + start * region.itemsize, count * region.itemsize)
        for src, off, n in region.ranges(start, count):
            self._append(src, off, n)
        return self

    def _append(self, src, off: int, n: int) -> "Flat":
        last = self.pieces[-1] if self.pieces else None
        if last is not None and last.src is src and last.src_off + last.nbytes == off:
            last.nbytes += n  # adjacent ranges are one copy
        else:
            self.pieces.append(Piece(src, off, n, self.nbytes))
        self.nbytes += n
        return self

    def zeros(self, region: Region, nbytes: int) -> "Flat":
        # Padding after padding (a ZeRO-3 rank past the end of many small parameters) grows the last
        # zero piece: any bytes of the zero region are zeros, so the copies stay few.
        last = self.pieces[-1] if self.pieces else None
        if (nbytes > 0 and last is not None and last.src is region.source and region.offset <= last.src_off
                and last.src_off + last.nbytes + nbytes <= region.offset + region.length):
            last.nbytes += nbytes
            self.nbytes += nbytes
            return self
        return self.add(region, 0, nbytes)


class FlatStorage(NewTensor):
    """A storage record that several tensors view (a flat group), or one with a strided view.

    pyckpt's writer takes a TensorRef's ``storage.numel`` as a number and copies a NewTensor's
    pieces; this is both, so views of made-up storages pickle exactly like torch's.
    """

    def __init__(self, dtype: str, numel: int, pieces: List[Piece]):
        super().__init__(dtype, (numel, ), pieces)
        self.numel = numel  # shadows NewTensor.numel(): the writer reads it as an attribute here


def _contiguous_stride(shape) -> Tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


def view(storage: FlatStorage, offset: int, shape, requires_grad=False, py_state=None) -> TensorRef:
    return TensorRef(storage, offset, tuple(shape), _contiguous_stride(shape), requires_grad, py_state)


def tensor(dtype: str, shape, flat: Flat, requires_grad=False) -> NewTensor:
    expected = math.prod(shape) * (4 if dtype == "float32" else 2)
    if flat.nbytes != expected:
        raise AssertionError(f"built {flat.nbytes} bytes for a {dtype}{list(shape)} tensor ({expected} expected)")
    return NewTensor(dtype, tuple(shape), flat.pieces, requires_grad)


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


@dataclass
class MoELayer:
    moe_layer_id: int
    module_path: str
    num_experts: int
    ep_size: int

    @property
    def num_local(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def prefix(self) -> str:
        return f"{self.module_path}.experts"


@dataclass
class Model:
    # trainable params in named_parameters() order (ds_id = index); expert shapes are per EP rank
    params: List[Tuple[str, Tuple[int, ...]]]
    expert_layer: Dict[str, MoELayer] = field(default_factory=dict)  # expert param -> its layer
    aliases: Dict[str, str] = field(default_factory=dict)  # module-only key -> the param it repeats
    layers: List[MoELayer] = field(default_factory=list)
    # Tensor parallel (Megatron-style): params holds one tp rank's (equal) slice shapes, and tp_kind
    # says how each slice relates to the whole: "column" (dim 0), "row" (dim 1), "two_sub" (two
    # fused halves, each split on dim 0), "vocab" (dim 0, padded rows stripped), "replicated",
    # "averaged" (differs per rank; the universal value is the mean).
    tp: int = 1
    tp_kind: Dict[str, str] = field(default_factory=dict)
    vocab_rows: int = 0  # the unpadded vocabulary (original_vocab_size)
    family: str = "toy"
    # Who publishes the tp metadata: "megatron" (a Megatron-DeepSpeed model's regex patterns) or
    # "autotp" (DeepSpeed AutoTP on a Hugging Face model: exact-name patterns plus an affine map of
    # every parameter, as collect_autotp_universal_checkpoint_info writes them in 0.19.8).
    tp_style: str = "megatron"

    @property
    def autoep(self) -> bool:
        return bool(self.layers)

    def numel(self) -> int:
        """Parameters of the whole model (experts counted over all EP ranks, tp slices over all TP ranks)."""
        total = 0
        for name, shape in self.params:
            layer = self.expert_layer.get(name)
            split = self.tp_kind.get(name) not in (None, "replicated", "averaged")
            total += math.prod(shape) * (layer.ep_size if layer else 1) * (self.tp if split else 1)
        return total

    def uc_info(self) -> dict:
        """The universal_checkpoint_info a Megatron-DeepSpeed model passes for this layout, or the
        one DeepSpeed AutoTP publishes (tp_style "autotp")."""
        if self.tp == 1:
            return {}  # the client_state every UCP user passes
        if self.tp_style == "autotp":
            return self._autotp_info()

        def pats(kind):
            return sorted({re.sub(r"\\.\d+\\.", r"\\.\\d+\\.", re.escape(n)) for n, k in self.tp_kind.items() if k == kind})

        return {
            "universal_checkpoint_version": 0.4,
            "tp_replicated_parameter_patterns": pats("replicated"),
            "parameter_to_average_patterns": pats("averaged"),
            "parameter_with_row_parallelism_patterns": pats("row"),
            "parameter_with_2_sub_params_cat_dim_0": pats("two_sub"),
            "vocabulary_parameter_patterns": pats("vocab"),
            "original_vocab_size": self.vocab_rows,
        }


    def _autotp_info(self) -> dict:
        # AutoTP names each parameter exactly (^name$), lists sorted; parameters it partitioned get a
        # map first, in module order, then the ones it left whole, as DeepSpeed 0.19.8's
        # collect_autotp_universal_checkpoint_info (module_inject/layers.py) collects them.
        kinds, shapes = self.tp_kind, dict(self.params)
        split = [n for n, _ in self.params if kinds[n] != "replicated"]
        whole = [n for n, _ in self.params if kinds[n] == "replicated"]
        return {
            "universal_checkpoint_version": 0.4,
            "parameter_with_row_parallelism_patterns": sorted(_exact(n) for n in split if kinds[n] == "row"),
            "tp_replicated_parameter_patterns": sorted(_exact(n) for n in whole),
            "vocabulary_parameter_patterns": sorted(_exact(n) for n in split if kinds[n] == "vocab"),
            "parameter_with_sub_params": [],
            "autotp_unsupported_parameter_patterns": {},
            "original_vocab_size": self.vocab_rows,
            "affine_map": {"version": 1,
                           "params": {_exact(n): autotp_map(shapes[n], kinds[n], self.tp) for n in split + whole}},
        }


def _exact(name: str) -> str:
    return f"^{re.escape(name)}$"


def _strides(shape) -> List[int]:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return out[::-1]


def autotp_map(shape, kind: str, tp: int) -> dict:
    """AutoTP's affine map of one parameter whose every tp rank holds a ``shape`` slice: "column" and
    "vocab" split on dim 0, "row" on dim 1, "replicated" whole on every rank (its replicated_map)."""
    shape = list(shape)
    if kind == "replicated":
        piece = {"shape": shape, "source": [0, _strides(shape)], "dest": [0, _strides(shape)],
                 "locations": list(range(tp))}
        return {"logical_shape": shape,
                "ranks": {r: {"shard_shape": list(shape), "pieces": [dict(piece)]} for r in range(tp)}}
    if kind == "row":
        logical, step = [shape[0], shape[1] * tp] + shape[2:], shape[1]
    elif kind in ("column", "vocab"):
        logical, step = [shape[0] * tp] + shape[1:], math.prod(shape)
    else:
        raise ValueError(f"AutoTP has no {kind!r} parameters")
    return {"logical_shape": logical,
            "ranks": {r: {"shard_shape": list(shape),
                          "pieces": [{"shape": list(shape), "source": [r * step, _strides(logical)],
                                      "dest": [0, _strides(shape)], "locations": [r]}]}
                      for r in range(tp)}}


def dense_model(layers: int, hidden: int) -> Model:
    params = []
    for i in range(layers):
        params += [(f"layers.{i}.weight", (hidden, hidden)), (f"layers.{i}.bias", (hidden, ))]
    params.append(("head.weight", (HEAD_ROWS, hidden)))
    return Model(params)


def tp_model(layers: int, hidden: int, tp: int) -> Model:
    """A Megatron-style stack cut into ``tp`` equal slices: a vocabulary-padded embedding, per layer
    a replicated norm, column-parallel QKV (+ bias), row-parallel attention output with a replicated
    bias, an averaged norm, a fused two-half gate/up (column) and a row-parallel down projection;
    a replicated final norm. ``hidden`` must be a multiple of ``tp``."""
    if hidden % tp:
        raise ValueError(f"hidden {hidden} is not divisible by --tp {tp}")
    h, k = hidden, hidden // tp
    vocab_pad = _ceil_to(VOCAB_TP, tp)
    params = [("embed.weight", (vocab_pad // tp, h))]
    kind = {"embed.weight": "vocab"}
    for i in range(layers):
        for name, shape, how in ((f"layers.{i}.input_norm.weight", (h, ), "replicated"),
                                 (f"layers.{i}.qkv.weight", (3 * k, h), "column"),
                                 (f"layers.{i}.qkv.bias", (3 * k, ), "column"),
                                 (f"layers.{i}.attn_out.weight", (h, k), "row"),
                                 (f"layers.{i}.attn_out.bias", (h, ), "replicated"),
                                 (f"layers.{i}.post_norm.weight", (h, ), "averaged"),
                                 (f"layers.{i}.gate_up.weight", (4 * k, h), "two_sub"),
                                 (f"layers.{i}.down.weight", (h, 2 * k), "row")):
            params.append((name, shape))
            kind[name] = how
    params.append(("final_norm.weight", (h, )))
    kind["final_norm.weight"] = "replicated"
    return Model(params, tp=tp, tp_kind=kind, vocab_rows=VOCAB_TP - 3)


def autoep_model(layers: int, hidden: int, experts: int, ep: int, moe_layers: int, ffn: Optional[int] = None,
                 attention: bool = True, final_norm_bias: Optional[bool] = None) -> Model:
    """Mixtral-like: embed, per layer [self_attn] + norm (+ router and fused experts), norm, lm_head.

    The MoE layers are spread evenly over the stack. As in the harness's TinyMoE under AutoEP, the
    router is registered twice in the module (``mlp.router.gate`` and ``mlp.gate.gate``): the alias is
    a module-state key with no optimizer state, which exercises the converters' module fallback.
    ``final_norm_bias=None`` keeps the final norm's bias only when that makes the dense param
    group's size odd, so its ZeRO partitions carry padding at every dp.
    """
    if moe_layers < 1 or moe_layers > layers:
        raise ValueError(f"--moe-layers must be in [1, layers={layers}], not {moe_layers}")
    if experts % ep:
        raise ValueError(f"--experts {experts} is not divisible by --ep {ep}")
    ffn = ffn or _default_ffn(hidden)
    nl = experts // ep
    moe_at = {k * layers // moe_layers for k in range(moe_layers)}
    m = Model([("model.embed_tokens.weight", (VOCAB, hidden))])
    for i in range(layers):
        base = f"model.layers.{i}"
        if attention:
            m.params += [(f"{base}.self_attn.weight", (hidden, hidden)), (f"{base}.self_attn.bias", (hidden, ))]
        m.params += [(f"{base}.norm.weight", (hidden, )), (f"{base}.norm.bias", (hidden, ))]
        if i in moe_at:
            layer = MoELayer(len(m.layers), f"{base}.mlp", experts, ep)
            m.layers.append(layer)
            router = f"{base}.mlp.router.gate.weight"
            m.params.append((router, (experts, hidden)))
            m.aliases[f"{base}.mlp.gate.gate.weight"] = router
            for w, shape in zip(WEIGHTS, ((nl, ffn, hidden), (nl, hidden, ffn), (nl, ffn, hidden))):
                name = f"{layer.prefix}.{w}"
                m.params.append((name, shape))
                m.expert_layer[name] = layer
    tail = [("model.norm.weight", (hidden, )), ("model.norm.bias", (hidden, )), ("lm_head.weight", (VOCAB, hidden))]
    if final_norm_bias is None:
        dense = sum(math.prod(s) for n, s in m.params + tail if n not in m.expert_layer)
        final_norm_bias = dense % 2 == 1
    m.params += [p for p in tail if final_norm_bias or p[0] != "model.norm.bias"]
    return m


def _default_ffn(hidden: int) -> int:
    return (hidden * 3 // 8) | 1  # odd, so expert rows never align with anything


def _largest_divisor_at_most(n: int, k: int) -> int:
    return next(d for d in range(max(1, min(n, k)), 0, -1) if n % d == 0)


def _gqa_heads(hidden: int, heads: Optional[int], kv_heads: Optional[int], tp: int = 1) -> Tuple[int, int]:
    """(query heads, key/value heads). Defaults follow Llama 3 / Mixtral (head_dim 128, 8 KV heads at
    4096 and 8192 wide) and shrink with the width, keeping fewer KV than query heads where the width
    allows it (hidden 8: 4 heads of 2, 2 KV heads)."""
    if heads is None:
        heads = _largest_divisor_at_most(hidden, max(4, hidden // 128))
        while tp > 1 and heads % tp and hidden % (heads * 2) == 0:
            heads *= 2
    if heads < 1 or hidden % heads:
        raise ValueError(f"--heads {heads} must divide --hidden {hidden}")
    if kv_heads is None:
        kv_heads = _largest_divisor_at_most(heads, max(1, min(8, heads // 2)))
        if tp > 1 and kv_heads % tp and heads % tp == 0:
            kv_heads = _largest_divisor_at_most(heads, tp) if tp <= heads else heads
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"--kv-heads {kv_heads} must divide the {heads} query heads")
    if tp > 1 and (heads % tp or kv_heads % tp):
        raise ValueError(f"--tp {tp} must divide the query heads ({heads}) and the KV heads ({kv_heads}); "
                         "pass --heads/--kv-heads or a wider --hidden")
    return heads, kv_heads


def _gqa_attention(base: str, hidden: int, heads: int, kv_heads: int, tp: int = 1):
    """(name, per-tp-rank shape, tp kind) of a Llama/Mixtral attention block: q/k/v column-parallel,
    o row-parallel, k/v with kv_heads * head_dim rows."""
    hd = hidden // heads
    return [(f"{base}.self_attn.q_proj.weight", (heads * hd // tp, hidden), "column"),
            (f"{base}.self_attn.k_proj.weight", (kv_heads * hd // tp, hidden), "column"),
            (f"{base}.self_attn.v_proj.weight", (kv_heads * hd // tp, hidden), "column"),
            (f"{base}.self_attn.o_proj.weight", (hidden, heads * hd // tp), "row")]


def _norms(base: str, hidden: int):
    return [(f"{base}.input_layernorm.weight", (hidden, ), "replicated"),
            (f"{base}.post_attention_layernorm.weight", (hidden, ), "replicated")]


def llama_model(layers: int, hidden: int, *, heads: Optional[int] = None, kv_heads: Optional[int] = None,
                ffn: Optional[int] = None, vocab: Optional[int] = None, tp: int = 1) -> Model:
    """LlamaForCausalLM's parameters in named_parameters() order (untied embeddings): 9 per layer + 3.

    With ``tp > 1`` the model as DeepSpeed AutoTP (``tensor_parallel.autotp_size``) cuts it and
    describes it: q/k/v and gate/up split on dim 0, o/down on dim 1, lm_head on dim 0 (a
    vocabulary parameter), the embedding and the norms left whole on every rank."""
    heads, kv_heads = _gqa_heads(hidden, heads, kv_heads, tp)
    ffn = ffn or 7 * hidden // 2  # Llama 3 8B/70B: 14336 at 4096, 28672 at 8192
    vocab = vocab or FAMILY_VOCAB["llama"]
    if tp > 1 and ffn % tp:
        raise ValueError(f"the MLP width {ffn} is not divisible by --tp {tp}")
    if tp > 1 and vocab % tp:
        # AutoTP cuts lm_head unevenly then; one slice shape per parameter is what this writes
        raise ValueError(f"--vocab {vocab} is not divisible by --tp {tp}")
    rows = vocab // tp
    spec = [("model.embed_tokens.weight", (vocab, hidden), "replicated")]
    for i in range(layers):
        base = f"model.layers.{i}"
        spec += _gqa_attention(base, hidden, heads, kv_heads, tp)
        spec += [(f"{base}.mlp.gate_proj.weight", (ffn // tp, hidden), "column"),
                 (f"{base}.mlp.up_proj.weight", (ffn // tp, hidden), "column"),
                 (f"{base}.mlp.down_proj.weight", (hidden, ffn // tp), "row")]
        spec += _norms(base, hidden)
    spec += [("model.norm.weight", (hidden, ), "replicated"), ("lm_head.weight", (rows, hidden), "vocab")]
    m = Model([(n, s) for n, s, _ in spec], family="llama")
    if tp > 1:
        m.tp, m.tp_kind, m.vocab_rows, m.tp_style = tp, {n: k for n, _, k in spec}, vocab, "autotp"
    return m


def _add_experts(m: Model, module_path: str, experts: int, ep: int, ffn: int, hidden: int) -> None:
    # AutoEP's GroupedExperts: w1/w3 [local, ffn, hidden], w2 [local, hidden, ffn], one EP rank's experts
    layer = MoELayer(len(m.layers), module_path, experts, ep)
    m.layers.append(layer)
    nl = experts // ep
    for w, shape in zip(WEIGHTS, ((nl, ffn, hidden), (nl, hidden, ffn), (nl, ffn, hidden))):
        name = f"{layer.prefix}.{w}"
        m.params.append((name, shape))
        m.expert_layer[name] = layer


def mixtral_model(layers: int, hidden: int, experts: int, ep: int, *, heads: Optional[int] = None,
                  kv_heads: Optional[int] = None, ffn: Optional[int] = None, vocab: Optional[int] = None) -> Model:
    """MixtralForCausalLM (transformers 5) after DeepSpeed AutoEP replaced every ``model.layers.{i}.mlp``
    (the mixtral preset's moe_layer_pattern) with an AutoEPMoELayer: ``mlp.router.gate.weight`` and
    the fused ``mlp.experts.w1/w2/w3``. The Mixtral adapter captures router logits at the router, so
    AutoEP also registers the router under the source's name ``gate``: the module state dict repeats
    the router weight as ``mlp.gate.gate.weight`` (a module-only key, no optimizer state)."""
    if experts % ep:
        raise ValueError(f"--experts {experts} is not divisible by --ep {ep}")
    heads, kv_heads = _gqa_heads(hidden, heads, kv_heads)
    ffn = ffn or 7 * hidden // 2  # Mixtral 8x7B: 14336 at 4096
    vocab = vocab or FAMILY_VOCAB["mixtral"]
    m = Model([("model.embed_tokens.weight", (vocab, hidden))], family="mixtral")
    for i in range(layers):
        base = f"model.layers.{i}"
        m.params += [(n, s) for n, s, _ in _gqa_attention(base, hidden, heads, kv_heads)]
        router = f"{base}.mlp.router.gate.weight"
        m.params.append((router, (experts, hidden)))
        m.aliases[f"{base}.mlp.gate.gate.weight"] = router
        _add_experts(m, f"{base}.mlp", experts, ep, ffn, hidden)
        m.params += [(n, s) for n, s, _ in _norms(base, hidden)]
    m.params += [("model.norm.weight", (hidden, )), ("lm_head.weight", (vocab, hidden))]
    return m


def deepseek_model(layers: int, hidden: int, experts: int, ep: int, *, dense_layers: int = 3,
                   heads: Optional[int] = None, vocab: Optional[int] = None) -> Model:
    """DeepseekV3ForCausalLM (transformers 5) after AutoEP's deepseek_v3 preset replaced the MoE
    ``model.layers.{i}.mlp`` (layers from ``dense_layers`` = first_k_dense_replace on).

    Per layer: MLA attention (q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm,
    kv_b_proj, o_proj), then either the dense ``mlp.{gate,up,down}_proj`` or the AutoEP layer:
    ``mlp.router.gate.weight``, ``mlp.experts.w1/w2/w3`` and the kept ``mlp.shared_experts`` MLP
    (replicated: trained in the dense param group), then the two norms. The DeepSeek adapter does
    not capture router logits at the router, so there is no router alias. Shapes are DeepSeek-V3's
    ratios (at hidden 7168: 128 heads, q_lora 1536, kv_lora 512, rope 64, nope/v 128, MLP 18432,
    expert MLP 2048), floored at 1. The router's e_score_correction_bias buffer is left out.
    """
    if experts % ep:
        raise ValueError(f"--experts {experts} is not divisible by --ep {ep}")
    if not 0 <= dense_layers < layers:
        raise ValueError(f"--dense-layers must be in [0, layers={layers}), not {dense_layers}")
    h = hidden
    heads = heads or max(1, h // 56)
    rope = max(1, h // 112)
    nope = v_dim = 2 * rope
    q_lora, kv_lora = max(1, 3 * h // 14), max(1, h // 14)
    ffn, moe_ffn = max(1, 18 * h // 7), max(1, 2 * h // 7)
    vocab = vocab or FAMILY_VOCAB["deepseek"]
    m = Model([("model.embed_tokens.weight", (vocab, h))], family="deepseek")
    for i in range(layers):
        base = f"model.layers.{i}"
        attn = f"{base}.self_attn"
        m.params += [(f"{attn}.q_a_proj.weight", (q_lora, h)), (f"{attn}.q_a_layernorm.weight", (q_lora, )),
                     (f"{attn}.q_b_proj.weight", (heads * (nope + rope), q_lora)),
                     (f"{attn}.kv_a_proj_with_mqa.weight", (kv_lora + rope, h)),
                     (f"{attn}.kv_a_layernorm.weight", (kv_lora, )),
                     (f"{attn}.kv_b_proj.weight", (heads * (nope + v_dim), kv_lora)),
                     (f"{attn}.o_proj.weight", (h, heads * v_dim))]
        if i < dense_layers:
            m.params += [(f"{base}.mlp.gate_proj.weight", (ffn, h)), (f"{base}.mlp.up_proj.weight", (ffn, h)),
                         (f"{base}.mlp.down_proj.weight", (h, ffn))]
        else:
            m.params.append((f"{base}.mlp.router.gate.weight", (experts, h)))
            _add_experts(m, f"{base}.mlp", experts, ep, moe_ffn, h)
            shared = f"{base}.mlp.shared_experts"
            m.params += [(f"{shared}.gate_proj.weight", (moe_ffn, h)), (f"{shared}.up_proj.weight", (moe_ffn, h)),
                         (f"{shared}.down_proj.weight", (h, moe_ffn))]
        m.params += [(n, s) for n, s, _ in _norms(base, h)]
    m.params += [("model.norm.weight", (h, )), ("lm_head.weight", (vocab, h))]
    return m


def size_model(params: int, layers: Optional[int], hidden: Optional[int], experts: int = 0, ep: int = 1,
               moe_layers: int = 0, tp: int = 1, family: str = "toy", *, heads: Optional[int] = None,
               kv_heads: Optional[int] = None, dense_layers: int = 3, vocab: Optional[int] = None) -> Model:
    """The model closest to ``params`` parameters for the given (or default) depth or width.

    With ``tp > 1`` the toy width searched is hidden / tp (so hidden stays a multiple of tp). The
    realistic families search widths in steps of 64 (so head counts stay natural)."""
    if family not in FAMILIES:
        raise ValueError(f"--family must be one of {', '.join(FAMILIES)}, not {family!r}")
    toy = family == "toy"
    if not toy:
        if moe_layers:
            raise ValueError(f"--moe-layers is a toy-model setting; --family {family} fixes which layers are MoE")
        if family != "llama" and tp > 1:
            raise ValueError("--tp with --experts: DeepSpeed refuses AutoEP combined with tensor parallelism")
        if family == "llama" and experts:
            raise ValueError("--family llama is dense: use --family mixtral or deepseek for experts")
        if family == "deepseek" and kv_heads is not None:
            raise ValueError("--kv-heads: DeepSeek's MLA attention has no KV heads")
    elif heads is not None or kv_heads is not None or vocab is not None:
        raise ValueError("--heads, --kv-heads and --vocab need --family llama, mixtral or deepseek")
    experts = experts or FAMILY_EXPERTS.get(family, 0)

    def build(n_layers, h):
        if family == "llama":
            return llama_model(n_layers, h, heads=heads, kv_heads=kv_heads, vocab=vocab, tp=tp)
        if family == "mixtral":
            return mixtral_model(n_layers, h, experts, ep, heads=heads, kv_heads=kv_heads, vocab=vocab)
        if family == "deepseek":
            return deepseek_model(n_layers, h, experts, ep, dense_layers=dense_layers, heads=heads, vocab=vocab)
        if experts:
            return autoep_model(n_layers, h, experts, ep, moe_layers)
        if tp > 1:
            return tp_model(n_layers, h * tp, tp)
        return dense_model(n_layers, h)

    if toy and tp > 1 and hidden is not None:
        if hidden % tp:
            raise ValueError(f"--hidden {hidden} is not divisible by --tp {tp}")
        hidden //= tp
    min_layers = max(1, moe_layers, dense_layers + 1 if family == "deepseek" else 1)

    if layers is not None and hidden is not None:
        return build(layers, hidden)
    if hidden is not None:
        lo = min_layers
        one, two = build(lo, hidden).numel(), build(lo + 1, hidden).numel()
        n_layers = max(lo, lo + round((params - one) / (two - one)))
        return build(n_layers, hidden)
    if layers is None:
        layers = max(2, min_layers, min(64, round(params ** (1 / 3) / 64)))
    if not toy:
        # numel grows with the width: bisect on multiples of 64, then the closer neighbour
        def size(k):
            return build(layers, 64 * k).numel()

        lo, hi = 1, 2
        while size(hi) < params:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if size(mid) <= params else (lo, mid)
        return build(layers, 64 * min((lo, hi), key=lambda k: abs(size(k) - params)))
    # numel grows with the width: bisect for the last odd width at or under the target, then take
    # whichever of it and the next odd width is closer.
    lo, hi = 1, 3
    while build(layers, hi).numel() < params:
        lo, hi = hi, hi * 2 + 1
    while hi - lo > 2:
        mid = (lo + hi) // 2 | 1
        if build(layers, mid).numel() <= params:
            lo = mid
        else:
            hi = mid
    best = min((lo, hi), key=lambda h: (abs(build(layers, h).numel() - params), h))
    return build(layers, max(best, 3))


# ----------------------------------------------------------------------------------------------
# Topology
# ----------------------------------------------------------------------------------------------


@dataclass
class Topology:
    dp: int
    ep: int = 1
    data_before_expert: bool = False  # DeepSpeed's use_data_before_expert_parallelism

    @property
    def edp(self) -> int:
        return self.dp // self.ep

    def ep_rank(self, d: int) -> int:
        return d // self.edp if self.data_before_expert else d % self.ep

    def edp_rank(self, d: int) -> int:
        return d % self.edp if self.data_before_expert else d // self.ep

    def edp_ranks(self, e: int) -> List[int]:
        """The dp ranks holding EP rank e's experts, in expert-DP rank order."""
        if self.data_before_expert:
            return list(range(e * self.edp, (e + 1) * self.edp))
        return list(range(e, self.dp, self.ep))


@dataclass
class Group:
    """A flat fp32 group (ZeRO-1/2 param group, or ZeRO-3 sub-group) and who partitions it."""

    index: int
    params: List[Tuple[str, Tuple[int, ...]]]
    world: int  # partition count
    expert: bool  # partitioned over the expert-DP group; one content per EP rank
    param_group: int  # index into the optimizer's param_groups

    def starts(self) -> List[int]:
        """Each parameter's offset in the flat group, then the group's numel (computed once: every rank asks)."""
        found = self.__dict__.get("_starts")
        if found is None:
            found = [0]
            for _, shape in self.params:
                found.append(found[-1] + math.prod(shape))
            self.__dict__["_starts"] = found
        return found

    def numel(self) -> int:
        return self.starts()[-1]

    def overlapping(self, start: int, end: int):
        """(index, name, offset, numel) of the parameters overlapping elements [start, end), found by
        bisection, so a rank's partition costs what it holds, not the whole group."""
        starts = self.starts()
        i = max(0, bisect.bisect_right(starts, start) - 1)
        while i < len(self.params) and starts[i] < end:
            if starts[i + 1] > start:
                yield i, self.params[i][0], starts[i], starts[i + 1] - starts[i]
            i += 1

    def content(self, topo: Topology, d: int) -> Tuple[int, int]:
        """(which content: 0, or the EP rank; partition rank) of dp rank d."""
        if self.expert:
            return topo.ep_rank(d), topo.edp_rank(d)
        return 0, d


# ----------------------------------------------------------------------------------------------
# The writer
# ----------------------------------------------------------------------------------------------


class _Writer:

    def __init__(self, model: Model, topo: Topology, stage: int, dtype: str, sub_group_size: Optional[int],
                 noise: Noise, seed: int, tag: str):
        self.m, self.topo, self.stage, self.dtype, self.sub_group_size = model, topo, stage, dtype, sub_group_size
        self.noise, self.seed, self.tag = noise, seed, tag
        self.lp_dtype = "bfloat16" if dtype == "bf16" else "float32"
        self.plan = Plan()
        # make_checkpoint hands each batch of archives to the executor as it fills, so the objects
        # and pickles of a many-rank checkpoint are never all in memory at once.
        self.flush = None
        self.batch = max(8, min(256, 50_000 // max(1, len(model.params))))  # ZeRO-3 files name every param
        self.ds_id = {name: i for i, (name, _) in enumerate(model.params)}
        self.shapes = dict(model.params)
        self._starts: Dict[tuple, int] = {}
        self._cache: Dict[str, object] = {}  # per-checkpoint objects every rank's file repeats

    def emit(self, relpath: str, obj) -> None:
        self.plan.add_archive(relpath, obj)
        if self.flush is not None and len(self.plan.archives) >= self.batch:
            self.flush(self.plan)
            self.plan = Plan()

    # -- where values come from --------------------------------------------------------------
    def _start(self, *key) -> int:
        # one hash per window, not per rank's fragment of it
        found = self._starts.get(key)
        if found is not None:
            return found
        digest = hashlib.blake2b(repr((self.seed, ) + key).encode(), digest_size=8).digest()
        found = self._starts[key] = int.from_bytes(digest, "little")
        return found

    def _region(self, state: str) -> Region:
        return self.noise.nonneg if state == "exp_avg_sq" else self.noise.f32

    def logical(self, state: str, group: Group, content: int, start: int, count: int, flat: Flat) -> Flat:
        """Elements [start, start+count) of a group's unpadded logical flat state, appended to flat.

        The logical flat is one wrapping window of the noise per (group, content, state), so every
        rank's fragment of it, the module weights and the per-expert files all agree with the
        full parameters a correct converter rebuilds.
        """
        if self.m.tp == 1:
            base = self._start("group", self.stage, group.index, content, state)
            return flat.add(self._region(state), base + start, count)
        return self._per_param(self._region(state), state, group, content, start, count, flat)

    def _per_param(self, region: Region, key: str, group: Group, content: int, start: int, count: int,
                   flat: Flat) -> Flat:
        # With tp, content is the tp rank and each parameter is its own window, so replicated
        # parameters (weights and moments) are equal on every tp rank, as training keeps them.
        end = start + count
        for _, name, o, n in group.overlapping(start, end):
            a, b = max(o, start), min(o + n, end)
            who = "all" if self.m.tp_kind[name] == "replicated" else content
            flat.add(region, self._start("param", name, who, key) + (a - o), b - a)
        return flat

    def lp(self, group: Group, content: int, start: int, count: int, flat: Flat) -> Flat:
        """Module (model dtype) values: the fp32 masters themselves in fp32, random bf16 otherwise."""
        if self.lp_dtype == "float32":
            return self.logical("fp32", group, content, start, count, flat)
        if self.m.tp > 1:
            return self._per_param(self.noise.bf16, "lp", group, content, start, count, flat)
        return flat.add(self.noise.bf16, self._start("lp", self.stage, group.index, content) + start, count)

    def step(self) -> NewTensor:
        return NewTensor("float32", (), [Piece(self.noise, self.noise.step_offset, 4, 0)])

    def pad(self, flat: Flat, elements: int, itemsize: int = 4) -> Flat:
        return flat.zeros(self.noise.zero, elements * itemsize)

    # -- groups ------------------------------------------------------------------------------
    def zero12_groups(self) -> List[Group]:
        dense = [(n, s) for n, s in self.m.params if n not in self.m.expert_layer]
        groups = [Group(0, dense, self.topo.dp, False, 0)]
        experts = [(n, s) for n, s in self.m.params if n in self.m.expert_layer]
        if experts:
            groups.append(Group(1, experts, self.topo.edp, True, 1))
        return groups

    def zero3_groups(self) -> List[Group]:
        """Each param group split into sub-groups the way stage3._create_fp16_sub_groups does."""
        out: List[Group] = []
        for pg in self.zero12_groups():
            params = pg.params
            sizes = [math.ceil(math.prod(s) / pg.world) for _, s in params]
            if self.sub_group_size is None or self.sub_group_size >= sum(sizes):
                chunks = [params]
            else:
                chunks, cur, acc = [], [], 0
                for (name, shape), q in zip(params, sizes):
                    cur.append((name, shape))
                    acc += q
                    if acc >= self.sub_group_size or name == params[-1][0]:
                        chunks.append(cur)
                        cur, acc = [], 0
            for chunk in chunks:
                out.append(Group(len(out), chunk, pg.world, pg.expert, pg.param_group))
        return out

    # -- common pieces of the model-state files ----------------------------------------------
    def ds_config(self) -> dict:
        found = self._cache.get("ds_config")
        if found is None:
            found = self._cache["ds_config"] = self._ds_config()
        return found

    def _ds_config(self) -> dict:
        zero = {"stage": self.stage}
        if self.stage == 3 and self.sub_group_size is not None:
            zero["sub_group_size"] = self.sub_group_size
        config = {
            "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "gradient_accumulation_steps": 1,
            "train_batch_size": MICRO_BATCH * self.topo.dp,
            "optimizer": {"type": "Adam", "params": {"lr": LR, "torch_adam": True, "adam_w_mode": False}},
            "zero_optimization": zero,
            "steps_per_print": 1_000_000,
        }
        if self.dtype == "bf16":
            config["bf16"] = {"enabled": True}
        if self.m.tp_style == "autotp" and self.m.tp > 1:
            config["tensor_parallel"] = {"autotp_size": self.m.tp, "preset_model": self.m.family}
        if self.m.autoep:
            config["expert_parallel"] = {"enabled": True, "autoep_size": self.topo.ep,
                                        "preset_model": AUTOEP_PRESET[self.m.family]}
            config["use_data_before_expert_parallelism"] = self.topo.data_before_expert
        return config

    def param_shapes(self, groups: Sequence[Group]) -> list:
        # AutoEP engines record plain tuples here; dense ones torch.Size (observed in 0.19.8 saves).
        found = self._cache.get("param_shapes")
        if found is None:
            shape_of = tuple if self.m.autoep else TorchSize
            found = self._cache["param_shapes"] = [OrderedDict((n, shape_of(s)) for n, s in g.params) for g in groups]
        return found

    def _layer_maps(self, layer: MoELayer) -> Tuple[dict, dict]:
        """(expert_placement, affine_maps params) of a layer: the same in every rank's file, so built once."""
        key = f"layer_maps/{layer.moe_layer_id}"
        found = self._cache.get(key)
        if found is None:
            nl = layer.num_local
            placement = {"version": 1, "num_experts": layer.num_experts, "ep_size": layer.ep_size,
                         "ranks": [{"rank": r, "experts": list(range(r * nl, (r + 1) * nl))} for r in range(layer.ep_size)]}
            affine = {}
            for w in WEIGHTS:
                name = f"{layer.prefix}.{w}"
                local = list(self.shapes[name])
                strides = list(_contiguous_stride(local))
                row = math.prod(local[1:])
                affine[name] = {"logical_shape": [layer.num_experts] + local[1:], "ranks": {
                    r: {"shard_shape": local, "pieces": [{"shape": local, "source": [r * nl * row, strides],
                                                          "dest": [0, strides], "locations": [r]}]}
                    for r in range(layer.ep_size)}}
            found = self._cache[key] = (placement, affine)
        return found

    def autoep_entries(self, d: int) -> list:
        """``ds_autoep_layers`` as dp rank d's engine writes it (0.19.8 fields, uniform placement)."""
        entries = []
        for layer in self.m.layers:
            nl, e = layer.num_local, self.topo.ep_rank(d)
            placement, affine = self._layer_maps(layer)
            entries.append({
                "moe_layer_id": layer.moe_layer_id,
                "module_path": layer.module_path,
                "num_experts": layer.num_experts,
                "num_local_experts": nl,
                "ep_size": layer.ep_size,
                "expert_placement": placement,
                "affine_maps": {"version": 1, "params": affine},
                "expert_key_prefix": layer.prefix,
                "checkpoint_format": "zero3_partitioned" if self.stage == 3 else "per_expert_files",
                "checkpoint_format_version": 1 if self.stage == 3 else None,
                "ep_group_name": f"ep_size_{layer.ep_size}",
                "ep_rank": e,
                "expert_data_parallel_rank": self.topo.edp_rank(d),
                "expert_data_parallel_world_size": self.topo.edp,
                "global_expert_start": e * nl,
                "global_expert_end": (e + 1) * nl,
            })
        return entries

    def model_state(self, module: "OrderedDict", groups: Sequence[Group], d: int) -> dict:
        stage1 = self.stage == 1
        state = {
            "module": module,
            "buffer_names": [],
            "optimizer": None,
            "param_shapes": self.param_shapes(groups),
            "frozen_param_shapes": None if stage1 else OrderedDict(),
            "shared_params": {},
            "frozen_param_fragments": None if stage1 else OrderedDict(),
            "lr_scheduler": None,
            "data_sampler": None,
            "random_ltd": None,
            "skipped_steps": 0,
            "global_steps": GLOBAL_STEPS,
            "global_samples": GLOBAL_STEPS * MICRO_BATCH * self.topo.dp,
            "dp_world_size": self.topo.dp,
            "mp_world_size": self.m.tp,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": self.m.tp},
            "ds_config": self.ds_config(),
            "ds_version": DS_VERSION,
        }
        if self.m.autoep:
            entries = self.autoep_entries(d)
            state["num_experts"] = [layer.num_experts for layer in self.m.layers]
            state["ds_autoep_layers"] = entries
            state["universal_checkpoint_info"] = {"universal_checkpoint_version": 0.4,
                                                  "expert_parameter_patterns": [".*\\.experts\\.w[123]$"],
                                                  "ds_autoep_layers": entries}
        else:
            state["universal_checkpoint_info"] = self.m.uc_info()
        return state

    def shard_name(self, d: int, t: int = 0) -> str:
        prefix = "bf16_" if self.dtype == "bf16" else ""
        return f"{self.tag}/{prefix}zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt"

    def param_groups(self, ids_per_group: List[List[int]]) -> list:
        if not self.m.autoep:
            return [adam_param_group(ids_per_group[0])]
        return [adam_param_group(ids_per_group[0], "dense-params"),
                adam_param_group(ids_per_group[1], f"ep_size_{self.topo.ep}", moe=True)]

    # -- ZeRO-1/2 ----------------------------------------------------------------------------
    def write_zero12(self) -> None:
        groups = self.zero12_groups()
        for t in range(self.m.tp):
            self.emit(f"{self.tag}/mp_rank_{t:02d}_model_states.pt",
                                  self.model_state(self.zero12_module(groups, t), groups, 0))
            for d in range(self.topo.dp):
                self.emit(self.shard_name(d, t), self.zero12_shard(groups, d, t))
        if self.m.autoep:
            self.write_expert_files(groups[1])

    def zero12_module(self, groups: List[Group], t: int = 0) -> "OrderedDict":
        dense = groups[0]
        offsets, o = {}, 0
        for name, shape in dense.params:
            offsets[name] = o
            o += math.prod(shape)
        shapes = dict(dense.params)
        itemsize = 4 if self.lp_dtype == "float32" else 2
        module = OrderedDict()
        if not self.m.autoep:
            # The bit16 params are views of one flat buffer padded to the ZeRO alignment, so
            # torch.save writes that whole buffer once.
            n = dense.numel()
            n_pad = _ceil_to(n, 2 * dense.world)
            storage = FlatStorage(self.lp_dtype, n_pad, self.pad(self.lp(dense, t, 0, n, Flat()), n_pad - n,
                                                                 itemsize).pieces)
            for name, shape in dense.params:
                module[name] = view(storage, offsets[name], shape)
            return module
        # AutoEP's non-expert state dict holds each tensor in its own storage; experts are left out.
        for key, name in self.module_keys():
            flat = self.lp(dense, 0, offsets[name], math.prod(shapes[name]), Flat())
            module[key] = tensor(self.lp_dtype, shapes[name], flat)
        return module

    def module_keys(self):
        """(module key, parameter) for the non-expert state dict: each parameter, then its aliases."""
        aliases_of: Dict[str, List[str]] = {}
        for alias, target in self.m.aliases.items():
            aliases_of.setdefault(target, []).append(alias)
        for name, _ in self.m.params:
            if name not in self.m.expert_layer:
                for key in [name] + aliases_of.get(name, []):
                    yield key, name

    def zero12_shard(self, groups: List[Group], d: int, t: int = 0) -> dict:
        state, fp32_parts, paddings, mappings = {}, [], [], []
        for g in groups:
            content, r = g.content(self.topo, d)
            if not g.expert:
                content = t  # AutoEP and TP never meet (DeepSpeed refuses the pair), so 0 without tp
            n = g.numel()
            part = _ceil_to(n, 2 * g.world) // g.world
            lo = r * part
            real = max(0, min(part, n - lo))
            moments = {}
            for key in ("exp_avg", "exp_avg_sq"):
                flat = self.pad(self.logical(key, g, content, lo, real, Flat()), part - real)
                moments[key] = tensor("float32", (part, ), flat)
            state[g.index] = {"step": self.step(), **moments}
            # The saved fp32 partition is a view of the padded partition with the padding cut off.
            storage = FlatStorage("float32", part, self.pad(self.logical("fp32", g, content, lo, real, Flat()),
                                                            part - real).pieces)
            fp32_parts.append(view(storage, 0, (real, ), requires_grad=True))
            paddings.append(part - real)
            frags = OrderedDict()
            for _, name, o, size in g.overlapping(lo, lo + part):
                a, b = max(o, lo), min(o + size, lo + part)
                frags[name] = fragment_address(b - a, a - lo)
            mappings.append(frags)
        osd = {
            "loss_scaler": loss_scaler(),
            "dynamic_loss_scale": False,
            "overflow": False,
            "clip_grad": 1.0,
            "base_optimizer_state": {"state": state,
                                     "param_groups": self.param_groups([[g.index] for g in groups])},
            "single_partition_of_fp32_groups": fp32_parts,
            "zero_stage": zero_stage_enum(self.stage),
            "group_paddings": paddings,
            "param_alignment_paddings": [[0] * len(g.params) for g in groups],
            "partition_count": [g.world for g in groups],
            "ds_version": DS_VERSION,
            "param_slice_mappings": mappings,
        }
        return {"optimizer_state_dict": osd, "ds_config": self.ds_config(), "ds_version": DS_VERSION}

    def write_expert_files(self, group: Group) -> None:
        """``layer_{L}_expert_{E}_mp_rank_00_model_states.pt``: each expert's rows in the model dtype."""
        offsets, o = {}, 0
        for name, shape in group.params:
            offsets[name] = o
            o += math.prod(shape)
        shapes = dict(group.params)
        for layer in self.m.layers:
            for e in range(layer.ep_size):
                for j in range(layer.num_local):
                    eid = e * layer.num_local + j
                    obj = {}
                    for w in WEIGHTS:
                        name = f"{layer.prefix}.{w}"
                        row_shape = shapes[name][1:]
                        row = math.prod(row_shape)
                        flat = self.lp(group, e, offsets[name] + j * row, row, Flat())
                        obj[f"{name}.{eid}"] = tensor(self.lp_dtype, row_shape, flat)
                    self.emit(
                        f"{self.tag}/layer_{layer.moe_layer_id}_expert_{eid}_mp_rank_00_model_states.pt", obj)

    # -- ZeRO-3 ------------------------------------------------------------------------------
    def write_zero3(self) -> None:
        groups = self.zero3_groups()
        for t, d in ((t, d) for t in range(self.m.tp) for d in range(self.topo.dp)):
            # ZeRO-3 keeps only placeholders; every rank's file has the same ones
            module = self._cache.get("zero3_module")
            if module is None:
                module = OrderedDict((key, NewTensor(self.lp_dtype, (0, ))) for key, _ in self.module_keys())
                self._cache["zero3_module"] = module
            self.emit(f"{self.tag}/zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt",
                                  self.model_state(module, groups, d))
            self.emit(self.shard_name(d, t), self.zero3_shard(groups, d, t))

    def zero3_shard(self, groups: List[Group], d: int, t: int = 0) -> dict:
        state, flats, partition_groups = {}, [], []
        for g in groups:
            content, r = g.content(self.topo, d)
            if not g.expert:
                content = t
            bufs = {key: Flat() for key in ("fp32", "exp_avg", "exp_avg_sq")}
            o = 0
            for name, shape in g.params:
                n = math.prod(shape)
                q = math.ceil(n / g.world)
                real = max(0, min(q, n - r * q))
                for key, flat in bufs.items():
                    self.pad(self.logical(key, g, content, o + r * q, real, flat), q - real)
                o += n
            size = bufs["fp32"].nbytes // 4
            state[g.index] = {"step": self.step(),
                              "exp_avg": tensor("float32", (size, ), bufs["exp_avg"]),
                              "exp_avg_sq": tensor("float32", (size, ), bufs["exp_avg_sq"])}
            ids = [self.ds_id[name] for name, _ in g.params]
            storage = FlatStorage("float32", size, bufs["fp32"].pieces)
            flats.append(view(storage, 0, (size, ), requires_grad=True, py_state={"ds_id": f"{ids[0]}_{ids[-1]}"}))
            if g.expert:
                e = self.topo.ep_rank(d)
                partition_groups.append({"sub_group": g.index, "partition_count": g.world, "partition_rank": r,
                                         "partition_ranks": self.topo.edp_ranks(e), "families": ["autoep_expert"],
                                         "group_names": [f"ep_size_{self.topo.ep}"]})
            else:
                partition_groups.append({"sub_group": g.index, "partition_count": g.world, "partition_rank": r,
                                         "partition_ranks": list(range(self.topo.dp)), "families": ["replicated"],
                                         "group_names": ["replicated"]})
        n_param_groups = 2 if self.m.autoep else 1
        ids_per_group = [[g.index for g in groups if g.param_group == i] for i in range(n_param_groups)]
        osd = {"zero_stage": zero_stage_enum(3), "loss_scaler": loss_scaler(), "dynamic_loss_scale": False,
               "overflow": False, "partition_count": self.topo.dp}
        if self.m.autoep:
            osd["ds_zero_partition_groups"] = partition_groups  # only written when experts exist
        osd["optimizer_state_dict"] = {"state": state, "param_groups": self.param_groups(ids_per_group)}
        osd["fp32_flat_groups"] = flats
        return {"optimizer_state_dict": osd, "ds_config": self.ds_config(), "ds_version": DS_VERSION}


def _ceil_to(n: int, k: int) -> int:
    return -(-n // k) * k


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------


def parse_count(text) -> int:
    """'1B', '350M', '50k', '2e9' or an int."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}.get(s[-1:], 1)
    return int(float(s[:-1] if scale != 1 else s) * scale)


def _recovery_scripts() -> List[str]:
    # DeepSpeed copies these next to `latest`; find them without importing deepspeed.
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return []
    base = os.path.join(list(spec.submodule_search_locations)[0], "utils")
    return [p for p in (os.path.join(base, s) for s in ("zero_to_fp32.py", "zero_to_torch.py")) if os.path.isfile(p)]


def check_topology(model: Model, *, dp: int, stage: int, dtype: str, ep: int, sub_group_size: Optional[int]) -> None:
    if stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1, 2 or 3, not {stage}")
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be fp32 or bf16, not {dtype!r}")
    if dp < 1 or ep < 1 or dp % ep:
        raise ValueError(f"--ep {ep} must divide --dp {dp}")
    if model.autoep and any(layer.ep_size != ep for layer in model.layers):
        raise ValueError("every AutoEP layer must use the run's ep size")
    if sub_group_size is not None and (stage != 3 or sub_group_size < 1):
        raise ValueError("--sub-group-size is a ZeRO-3 setting (a positive element count)")
    if model.tp > 1 and model.autoep:
        raise ValueError("--tp with --experts: DeepSpeed refuses AutoEP combined with tensor parallelism")


def build_plan(model: Model, *, dp: int, stage: int, dtype: str = "fp32", ep: int = 1,
               sub_group_size: Optional[int] = None, data_before_expert: bool = False, seed: int = 0,
               noise: Noise, tag: Optional[str] = None) -> Plan:
    """The Plan writing ``tag/`` for an explicit model (relative paths; ``latest`` is not in it)."""
    check_topology(model, dp=dp, stage=stage, dtype=dtype, ep=ep, sub_group_size=sub_group_size)
    tag = tag or f"global_step{GLOBAL_STEPS}"
    return _write(_Writer(model, Topology(dp, ep, data_before_expert), stage, dtype, sub_group_size, noise, seed, tag))


def _write(writer: "_Writer") -> Plan:
    """Runs the writer; returns what it has not flushed (everything, when it has no flush)."""
    if writer.stage == 3:
        writer.write_zero3()
    else:
        writer.write_zero12()
    return writer.plan


def make_checkpoint(out, *, params="1B", dp: int, stage: int, dtype: str = "fp32", layers: Optional[int] = None,
                    hidden: Optional[int] = None, experts: int = 0, ep: int = 1, moe_layers: int = 0,
                    sub_group_size: Optional[int] = None, data_before_expert: bool = False, seed: int = 0,
                    workers: Optional[int] = None, model: Optional[Model] = None, overwrite: bool = False,
                    report: Optional[dict] = None, tp: int = 1, family: str = "toy", heads: Optional[int] = None,
                    kv_heads: Optional[int] = None, dense_layers: int = 3, vocab: Optional[int] = None) -> Path:
    """Write a DeepSpeed 0.19.8 ZeRO checkpoint under ``out``; returns the tag folder.

    ``params`` is the target parameter count (an int or '1B', the default); ``layers``/``hidden`` pin
    the depth or width, the other is solved for (with both, ``params`` is unused). ``experts > 0`` makes an AutoEP model with ``moe_layers``
    MoE layers of ``experts`` experts over ``ep`` EP ranks (``moe_layers`` defaults to 2). ``tp > 1``
    makes a Megatron-style tensor-parallel model (:func:`tp_model`), one set of files per tp rank.
    ``family`` picks a realistic layout instead of the toy one: ``llama`` (:func:`llama_model`, also
    with ``tp``), ``mixtral`` and ``deepseek`` (AutoEP, :func:`mixtral_model`, :func:`deepseek_model`;
    ``experts`` defaults to 8 and 256), shaped by ``heads``, ``kv_heads``, ``dense_layers``, ``vocab``. ``model``
    overrides the sizing with an explicit :class:`Model`. ``report``, if given, receives the
    model's numel, bytes written, file count and seconds.
    """
    t0 = time.perf_counter()
    out = Path(out)
    if model is None:
        if family in ("mixtral", "deepseek"):
            experts = experts or FAMILY_EXPERTS[family]
        elif family != "toy":
            if experts or ep != 1:
                raise ValueError(f"--family {family} is dense: --experts/--ep need --family mixtral or deepseek")
        elif experts:
            moe_layers = moe_layers or 2
        elif moe_layers or ep != 1:
            raise ValueError("--ep and --moe-layers need --experts")
        if tp < 1:
            raise ValueError(f"--tp must be positive, not {tp}")
        if tp > 1 and experts:
            raise ValueError("--tp with --experts: DeepSpeed refuses AutoEP combined with tensor parallelism")
        model = size_model(parse_count(params), layers, hidden, experts, ep, moe_layers, tp, family, heads=heads,
                           kv_heads=kv_heads, dense_layers=dense_layers, vocab=vocab)
    check_topology(model, dp=dp, stage=stage, dtype=dtype, ep=ep, sub_group_size=sub_group_size)
    tag = f"global_step{GLOBAL_STEPS}"
    tag_dir = out / tag
    if tag_dir.exists():
        if not overwrite:
            raise FileExistsError(f"{tag_dir} exists (pass overwrite=True / --overwrite to replace it)")
        shutil.rmtree(tag_dir)
    out.mkdir(parents=True, exist_ok=True)
    noise_path = out / f".make_checkpoint-noise-{os.getpid()}.bin"
    try:
        noise = Noise(str(noise_path), seed)
        writer = _Writer(model, Topology(dp, ep, data_before_expert), stage, dtype, sub_group_size, noise, seed, tag)
        result = {"bytes_written": 0, "files": 0}
        busy = [0.0]  # seconds in the executor (the rest is planning and pickling)

        def flush(plan: Plan) -> None:
            if not (plan.archives or plan.raw_files or plan.copies):
                return
            t = time.perf_counter()
            done = execute(plan, str(out), workers)
            for key in result:
                result[key] += done[key]
            busy[0] += time.perf_counter() - t

        writer.flush = flush
        flush(_write(writer))
        t1 = time.perf_counter() - busy[0]
        for script in _recovery_scripts():  # plain files, not checkpoint archives: copied as they are
            shutil.copy2(script, out / os.path.basename(script))
    finally:
        if noise_path.exists():
            noise_path.unlink()
    (out / "latest").write_text(tag)  # DeepSpeed writes the tag with no newline
    if report is not None:
        report.update(numel=model.numel(), bytes=result["bytes_written"], files=result["files"],
                      plan_seconds=t1 - t0, seconds=time.perf_counter() - t0, model=model)
    return tag_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/make_checkpoint.py",
                                description="Write a synthetic DeepSpeed 0.19.8 ZeRO checkpoint (pp = 1) of any size "
                                "in seconds, through pyckpt's writer. OUT gets `latest` and global_step1/.")
    p.add_argument("out", help="the save dir: gets `latest` and global_step1/")
    p.add_argument("--params", default="1B", help="target parameter count: 1B, 350M, 50k, ... (default 1B)")
    p.add_argument("--dp", type=int, required=True, help="data-parallel degree (number of ZeRO shards)")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), required=True)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="model dtype (masters stay fp32)")
    p.add_argument("--layers", type=int, help="number of layers (default: from --params)")
    p.add_argument("--hidden", type=int, help="hidden size (default: solved from --params and --layers)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: a Megatron-style model cut into tp slices (column, row, fused, "
                        "vocabulary, replicated and averaged parameters), files per tp rank")
    p.add_argument("--family", choices=FAMILIES, default="toy",
                   help="parameter layout: toy (default: the small synthetic stacks), llama (LlamaForCausalLM names, "
                        "9 per layer + 3; with --tp, as DeepSpeed AutoTP cuts it), mixtral or deepseek (DeepSeek-V3) under AutoEP")
    p.add_argument("--heads", type=int, help="llama/mixtral/deepseek: attention heads (default: from --hidden)")
    p.add_argument("--kv-heads", type=int, help="llama/mixtral: key/value heads (grouped-query; default from --heads)")
    p.add_argument("--dense-layers", type=int, default=3,
                   help="deepseek: the first N layers keep a dense MLP (first_k_dense_replace; default 3)")
    p.add_argument("--vocab", type=int, help="llama/mixtral/deepseek: vocabulary rows (default: the real model's)")
    p.add_argument("--experts", type=int, default=0,
                   help="AutoEP experts per MoE layer (0: dense model; mixtral/deepseek default 8/256)")
    p.add_argument("--ep", type=int, default=1, help="AutoEP size (EP ranks); must divide --dp and --experts")
    p.add_argument("--moe-layers", type=int, default=0, help="number of MoE layers (default 2 with --experts)")
    p.add_argument("--data-before-expert", action="store_true",
                   help="use_data_before_expert_parallelism: EP rank e owns dp ranks [e*dp/ep, (e+1)*dp/ep)")
    p.add_argument("--sub-group-size", type=int, help="ZeRO-3 sub_group_size (elements per rank)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", "-j", type=int, help="copy threads (default: one per core)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT/global_step1 if it exists")
    args = p.parse_args(argv)
    info: dict = {}
    try:
        tag_dir = make_checkpoint(args.out, params=args.params, dp=args.dp, stage=args.stage, dtype=args.dtype,
                                  layers=args.layers, hidden=args.hidden, experts=args.experts, ep=args.ep,
                                  moe_layers=args.moe_layers, sub_group_size=args.sub_group_size,
                                  data_before_expert=args.data_before_expert, seed=args.seed, workers=args.workers,
                                  overwrite=args.overwrite, report=info, tp=args.tp, family=args.family,
                                  heads=args.heads, kv_heads=args.kv_heads, dense_layers=args.dense_layers,
                                  vocab=args.vocab)
    except (ValueError, FileExistsError) as exc:  # bad arguments: one line, no traceback
        print(f"make_checkpoint: error: {exc}", file=sys.stderr)
        return 2
    m = info["model"]
    kind = f"AutoEP ({len(m.layers)} MoE layers x {m.layers[0].num_experts} experts, ep {args.ep})" if m.autoep else "dense"
    if m.tp > 1:
        kind += f", tp {m.tp}"
    if m.family != "toy":
        kind = f"{m.family} ({len(m.params)} params{'' if m.tp == 1 else ' per tp rank'}), {kind}"
    print(f"{tag_dir}: {info['numel']:,} params, {kind}, ZeRO-{args.stage} {args.dtype} dp {args.dp}; "
          f"{info['files']} files, {info['bytes'] / 1e9:.2f} GB in {info['seconds']:.2f} s "
          f"(plan {info['plan_seconds']:.2f} s; {info['bytes'] / 1e9 / info['seconds']:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
