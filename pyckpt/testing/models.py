"""Parameter layouts: the toy stacks, and the real models' names and shapes at any width (Llama,
Mixtral and DeepSeek-V3 under AutoEP, AutoTP's cut of Llama).

Longer than most modules because it is a table: one short builder per model family, read side by side."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple




HEAD_ROWS = 7  # the dense model's output head: an odd row count keeps the flat groups unaligned
VOCAB = 11  # the AutoEP model's embedding / lm_head rows (as the harness's TinyMoE)
VOCAB_TP = 37  # the TP model's vocabulary before padding to a multiple of tp (3 padded rows are stripped)
WEIGHTS = ("w1", "w2", "w3")
# Realistic layouts (--family): Hugging Face names, as the models are built for training under DeepSpeed.
FAMILIES = ("toy", "llama", "mixtral", "deepseek")
FAMILY_VOCAB = {"llama": 128256, "mixtral": 32000, "deepseek": 129280}  # Llama 3, Mixtral 8x7B, DeepSeek-V3
FAMILY_EXPERTS = {"mixtral": 8, "deepseek": 256}
AUTOEP_PRESET = {"toy": "mixtral", "mixtral": "mixtral", "deepseek": "deepseek_v3"}


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
    # persistent float32 buffers, each listed under the parameter its module state-dict key comes just
    # before (a module's own buffers precede its children's parameters in state_dict order)
    buffers_before: Dict[str, List[Tuple[str, Tuple[int, ...]]]] = field(default_factory=dict)
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
    vocab_pad = ceil_to(VOCAB_TP, tp)
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
    expert MLP 2048), floored at 1. The source gate's ``e_score_correction_bias`` buffer ``[experts]``
    is copied onto the router as ``mlp.router.e_score_correction_bias`` (DeepSpeed 0.19.8
    ``auto_ep_layer._copy_e_score_correction_bias``), kept in float32 under bf16 too
    (``runtime/keep_in_fp32``: transformers lists it in ``_keep_in_fp32_modules_strict``); the router's
    own buffer comes before its ``gate`` child's weight in the module state dict.
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
            m.buffers_before[f"{base}.mlp.router.gate.weight"] = [(f"{base}.mlp.router.e_score_correction_bias",
                                                                   (experts, ))]
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


def ceil_to(n: int, k: int) -> int:
    return -(-n // k) * k
