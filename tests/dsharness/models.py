"""The models and the training data the harness drives DeepSpeed with.

Imported by the worker processes only; kept free of DeepSpeed imports so that it stays cheap
and so that the parent pytest process never has to import DeepSpeed.
"""

import torch
from torch import nn
import torch.nn.functional as F

# Every rank seeds the same generator before building the model, so ZeRO's "all ranks start
# from identical weights" assumption holds without a broadcast; the load worker uses the same
# seed, which is why frozen parameters and buffers compare equal after a universal load even
# though DeepSpeed never reads them back (see NOTES.md).
INIT_SEED = 1234
MICRO_BATCH = 2
# The second param group of Config.groups: settings unlike the config's Adam defaults.
BIAS_GROUP = {"lr": 3e-3, "betas": (0.8, 0.95), "weight_decay": 0.05}


class Tiny(nn.Module):
    """Linear(4,7) -> ReLU -> Linear(7,3): 28+7+21+3 = 59 parameters.

    59 is prime, so the flat ZeRO-1/2 buffer needs alignment padding at every dp in {2, 3, 4};
    under ZeRO-3 at least one tensor is unevenly split at each of those dp, and at dp=4 the
    3-element bias leaves the last rank with no real element at all.
    """

    in_features = 4
    out_features = 3

    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(self.in_features, 7)
        self.l1 = nn.Linear(7, self.out_features)

    def forward(self, x, y):
        h = self.l1(F.relu(self.l0(x)))
        # The loss is taken in fp32 so that bf16 runs do not produce a degenerate loss.
        return F.mse_loss(h.float(), y.float())


class Wide(Tiny):
    """Tiny's shape at page scale: Linear(1024,1024) -> ReLU -> Linear(1024,3), 1,052,675 parameters,
    so each universal state file of the first weight spans 1024 pages and a rank's share of it can
    be counted in the page cache."""

    in_features = 1024
    out_features = 3

    def __init__(self):
        nn.Module.__init__(self)
        self.l0 = nn.Linear(self.in_features, 1024)
        self.l1 = nn.Linear(1024, self.out_features)


class FrozenTied(nn.Module):
    """Embedding whose weight is tied to the output projection, a frozen weight, and buffers.

    Trainable: emb.weight (13x5 = 65, shared with out.weight) and proj.bias (5); 70 in total,
    which no ZeRO-1/2 alignment (4, 6, 8) divides. Frozen: proj.weight (25).
    Buffers: `scale` (persistent float, constant) and `counter`
    (persistent int64, bumped by every training forward, so the saved value is the number of
    training forwards and differs from its initial value).
    """

    vocab = 13
    dim = 5
    seq = 3

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(self.vocab, self.dim)
        self.proj = nn.Linear(self.dim, self.dim)
        self.proj.weight.requires_grad_(False)
        self.out = nn.Linear(self.dim, self.vocab, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, self.dim))
        self.register_buffer("counter", torch.zeros((), dtype=torch.int64))

    def forward(self, ids, target):
        if self.training:
            # Bumped before any use so autograd never sees a buffer that changed under it.
            with torch.no_grad():
                self.counter += 1
        # DeepSpeed casts parameters to bf16 but leaves buffers fp32, so the product is fp32
        # and has to be brought back to the weights' dtype.
        h = (self.emb(ids) * self.scale).to(self.proj.weight.dtype)
        h = F.relu(self.proj(h))
        logits = self.out(h)
        return F.cross_entropy(logits.float().reshape(-1, self.vocab), target.reshape(-1))


class MoEConfig:
    """The attributes DeepSpeed's "mixtral" AutoEP preset reads from `model.config`.

    `num_local_experts` / `num_experts_per_tok` are the preset's num_experts_attr / top_k_attr.
    No `model_type`: with one, AutoEP would apply its Hugging Face compatibility checks.
    """

    num_local_experts = 8
    num_experts_per_tok = 2
    hidden_size = 10
    intermediate_size = 6
    num_hidden_layers = 2
    vocab_size = 11


class MixtralExperts(nn.Module):
    """Experts in the Transformers 5 Mixtral layout: fused 3-D parameters, gate rows first.

    gate_up_proj [E, 2F, H] (gate = rows :F, up = rows F:), down_proj [E, H, F]. AutoEP repacks
    them into w1 = gate, w3 = up ([E_local, F, H]) and w2 = down ([E_local, H, F]).
    """

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        e, f, h = cfg.num_local_experts, cfg.intermediate_size, cfg.hidden_size
        self.ffn = f
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * f, h) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(e, h, f) * 0.3)
        # AutoEP probes act_fn numerically and refuses a preset whose activation disagrees.
        self.act_fn = F.silu

    def forward(self, x, top_idx, top_w):
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            rows, slot = torch.nonzero(top_idx == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            gate, up = (x[rows] @ self.gate_up_proj[e].t()).split(self.ffn, dim=-1)
            y = (self.act_fn(gate) * up) @ self.down_proj[e].t()
            out.index_add_(0, rows, (y * top_w[rows, slot, None]).to(out.dtype))
        return out


class SparseMoeBlock(nn.Module):
    """Mixtral's MoE block: softmax router, top-k, renormalised weights. AutoEP replaces it
    (the preset matches `model.layers.<N>.mlp` having children `gate` and `experts`)
    before the first forward, so this forward only documents what the replacement computes."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=False)
        self.experts = MixtralExperts(cfg)

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        top_w, top_idx = probs.topk(self.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return self.experts(x, top_idx, top_w).reshape(b, s, h)


class MoEDecoderLayer(nn.Module):

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden_size)
        self.mlp = SparseMoeBlock(cfg)

    def forward(self, h):
        return h + self.mlp(self.norm(h))


class MoEBackbone(nn.Module):

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MoEDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class TinyMoE(nn.Module):
    """A two-layer Mixtral-shaped language model for AutoEP ("preset_model": "mixtral").

    Module paths follow Hugging Face Mixtral (`model.layers.N.mlp.{gate,experts}`), which is
    what the preset's patterns match. H=10, F=6, 8 experts, top-2, vocabulary 11. Dense part:
    embedding, a LayerNorm per layer, final LayerNorm, untied lm_head. H, F and the expert count
    all differ, so every expert tensor and the router ([8, 10]) have an asymmetric shape.
    """

    vocab = MoEConfig.vocab_size
    seq = 6

    def __init__(self):
        super().__init__()
        self.config = MoEConfig()
        self.model = MoEBackbone(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.vocab, bias=False)

    def forward(self, ids, target):
        logits = self.lm_head(self.model(ids))
        return F.cross_entropy(logits.float().reshape(-1, self.vocab), target.reshape(-1))


class LlamaConfig:
    """What AutoTP reads from `model.config` (tp_shard.AutoTPMeta.from_model_config).

    `num_key_value_heads` decides how every attention-side dimension is split: a dimension
    divisible by it is cut on KV-head boundaries, while names containing "mlp",
    "gate_proj"/"up_proj"/"down_proj" and the lm_head are split as evenly as possible. No
    `model_type`: nothing in the llama preset is gated on it.

    8 query heads over 4 KV heads of width 2 (GQA): q 16 rows, k and v 8 rows each, so tp 1, 2
    and 4 all give every rank at least one KV head.
    """

    vocab_size = 37
    hidden_size = 16
    num_attention_heads = 8
    num_key_value_heads = 4
    head_dim = 2
    intermediate_size = 24
    num_hidden_layers = 2
    rms_norm_eps = 1e-6


class LlamaKV2Config(LlamaConfig):
    """Same tensor shapes as LlamaConfig, but 4 query heads over 2 KV heads of width 4: at tp 4,
    TP ranks 2 and 3 hold no attention head, i.e. zero-row q/k/v shards and zero-column o_proj
    shards (what DeepSpeed 0.19.8 does with those: NOTES.md "AutoTP")."""

    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 4


class RMSNorm(nn.Module):

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        # Not ones: an all-ones weight would make a replicated-parameter mix-up invisible.
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(x.dtype)


def _attend(q, k, v, head_dim: int):
    """Causal GQA attention over whatever heads this TP rank holds.

    The head counts come from the (possibly sharded) projection widths, not from the config:
    AutoTP cuts q/k/v on KV-head boundaries, so a rank holds n_rep query heads per local KV
    head, in the same order as the unsharded model. At tp > num_key_value_heads some ranks
    hold no head at all; their zero-width output makes o_proj contribute zeros to the
    row-parallel all-reduce. Those ranks must still run the same ops on their empty q/k/v: the
    column-parallel layers all-reduce the input gradient in backward, so an unused (k, v)
    projection on one rank leaves its TP peers waiting in a collective it never joins (seen: a
    gloo size mismatch in the next grad-norm all-reduce).
    """
    b, s, width = q.shape
    hq, hk = width // head_dim, k.shape[-1] // head_dim
    rep = hq // hk if hk else 1
    q = q.reshape(b, s, hq, head_dim).transpose(1, 2)
    k = k.reshape(b, s, hk, head_dim).transpose(1, 2).repeat_interleave(rep, dim=1)
    v = v.reshape(b, s, hk, head_dim).transpose(1, 2).repeat_interleave(rep, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * head_dim**-0.5
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1).to(v.dtype)
    return (probs @ v).transpose(1, 2).reshape(b, s, hq * head_dim)


class LlamaAttention(nn.Module):
    """Separate q/k/v/o projections. q/k/v carry biases as in Qwen2, o_proj one too, so that both
    AutoTP bias layouts appear: column-parallel (split like its weight) and row-parallel
    (replicated)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.head_dim = d
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h)

    def forward(self, x):
        return self.o_proj(_attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), self.head_dim))


class FusedLlamaAttention(nn.Module):
    """Phi-3-style fused `qkv_proj` = [Q; K; V] rows (16 + 8 + 8), sharded by AutoTP as three
    sub-parameters of unequal size (harness partition_config spec, shape ((16, 8, 8), -1)).

    A rank's shard is [its Q rows; its K rows; its V rows]. Q and K/V are cut on the same KV-head
    boundaries, so the local Q:K:V widths keep the global 2:1:1 ratio.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.head_dim = d
        self.q_share = cfg.num_attention_heads
        self.kv_share = cfg.num_key_value_heads
        self.qkv_proj = nn.Linear(h, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)

    def forward(self, x):
        qkv = self.qkv_proj(x)
        width = qkv.shape[-1]
        q_w = width * self.q_share // (self.q_share + 2 * self.kv_share)
        kv_w = (width - q_w) // 2
        q, k, v = qkv.split([q_w, kv_w, kv_w], dim=-1)
        return self.o_proj(_attend(q, k, v, self.head_dim))


class LlamaMLP(nn.Module):

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FusedLlamaMLP(nn.Module):
    """Fused `gate_up_proj` = [gate; up] rows, sharded as two equal sub-parameters (spec shape
    (2, -1)): a rank's shard is [its gate rows; its up rows]."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):

    def __init__(self, cfg: LlamaConfig, fused: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = FusedLlamaAttention(cfg) if fused else LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = FusedLlamaMLP(cfg) if fused else LlamaMLP(cfg)

    def forward(self, h):
        h = h + self.self_attn(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaBackbone(nn.Module):

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, fused=i == 1) for i in range(cfg.num_hidden_layers))
        # A LayerNorm (with bias) rather than a third RMSNorm: one more replicated tensor shape.
        self.norm = nn.LayerNorm(cfg.hidden_size)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class TinyLlama(nn.Module):
    """A two-layer Llama for AutoTP ("preset_model": "llama"), module paths as in Hugging Face.

    Layer 0 has the preset's layout (separate q/k/v/o, gate/up/down); layer 1 the fused
    variants (`qkv_proj`, `gate_up_proj`) that worker.AUTOTP_EXTRA_SPECS shards as
    sub-parameters, so one checkpoint carries plain column/row splits, sub-parameter splits
    with recorded shard widths, replicated parameters (norms, embedding, the o_proj bias) and,
    through the untied column-parallel `lm_head` (vocabulary 37, odd: 19 + 18 rows at tp 2),
    the vocabulary metadata. Hidden 16, intermediate 24; heads: see LlamaConfig.
    """

    config_class = LlamaConfig
    vocab = LlamaConfig.vocab_size
    seq = 6

    def __init__(self):
        super().__init__()
        self.config = self.config_class()
        self.model = LlamaBackbone(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.vocab, bias=False)

    def forward(self, ids, target):
        logits = self.lm_head(self.model(ids))
        return F.cross_entropy(logits.float().reshape(-1, self.vocab), target.reshape(-1))


class TinyLlamaKV2(TinyLlama):
    config_class = LlamaKV2Config


MODELS = {"tiny": Tiny, "wide": Wide, "frozen_tied": FrozenTied, "moe": TinyMoE, "llama": TinyLlama, "llama_kv2": TinyLlamaKV2}
# The AutoTP models (worker: tensor_parallel section; Config: tp_size allowed).
LLAMA_MODELS = ("llama", "llama_kv2")


def build_model(name: str) -> nn.Module:
    torch.manual_seed(INIT_SEED)
    return MODELS[name]()


def batch(name: str, rank: int, step: int, dtype: torch.dtype):
    """Different data on every rank and step, so the dp gradient all-reduce is not a no-op.

    Under tensor parallelism `rank` must be the data-parallel rank: the ranks of one TP group
    have to see the same batch (DeepSpeed checks that on the first forward).
    """
    g = torch.Generator().manual_seed(100_000 + 1_000 * step + rank)
    if name in ("tiny", "wide"):
        cls = Tiny if name == "tiny" else Wide
        x = torch.randn(MICRO_BATCH, cls.in_features, generator=g).to(dtype)
        y = torch.randn(MICRO_BATCH, cls.out_features, generator=g)
        return x, y
    cls = {"moe": TinyMoE, "llama": TinyLlama, "llama_kv2": TinyLlama}.get(name, FrozenTied)
    if name in LLAMA_MODELS:
        # Consecutive windows of a fixed token permutation: the 6 micro-batches of a dp-2,
        # 3-step run (72 tokens) cover all 37 embedding rows, so every row gets a gradient.
        perm = torch.randperm(cls.vocab, generator=torch.Generator().manual_seed(INIT_SEED))
        n = MICRO_BATCH * cls.seq
        ids = perm[(torch.arange(n) + n * (2 * step + rank)) % cls.vocab].reshape(MICRO_BATCH, cls.seq)
        target = torch.randint(0, cls.vocab, (MICRO_BATCH, cls.seq), generator=g)
        return ids, target
    ids = torch.randint(0, cls.vocab, (MICRO_BATCH, cls.seq), generator=g)
    target = torch.randint(0, cls.vocab, (MICRO_BATCH, cls.seq), generator=g)
    return ids, target
