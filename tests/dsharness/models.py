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


MODELS = {"tiny": Tiny, "frozen_tied": FrozenTied}


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
    ids = torch.randint(0, FrozenTied.vocab, (MICRO_BATCH, FrozenTied.seq), generator=g)
    target = torch.randint(0, FrozenTied.vocab, (MICRO_BATCH, FrozenTied.seq), generator=g)
    return ids, target
