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


MODELS = {"tiny": Tiny, "frozen_tied": FrozenTied, "moe": TinyMoE}


def build_model(name: str) -> nn.Module:
    torch.manual_seed(INIT_SEED)
    return MODELS[name]()


def batch(name: str, rank: int, step: int, dtype: torch.dtype):
    """Different data on every rank and step, so the dp gradient all-reduce is not a no-op."""
    g = torch.Generator().manual_seed(100_000 + 1_000 * step + rank)
    if name == "tiny":
        x = torch.randn(MICRO_BATCH, Tiny.in_features, generator=g).to(dtype)
        y = torch.randn(MICRO_BATCH, Tiny.out_features, generator=g)
        return x, y
    cls = TinyMoE if name == "moe" else FrozenTied
    ids = torch.randint(0, cls.vocab, (MICRO_BATCH, cls.seq), generator=g)
    target = torch.randint(0, cls.vocab, (MICRO_BATCH, cls.seq), generator=g)
    return ids, target
