"""torchtitan's own Llama3 model and AdamW resuming from pyckpt's ``--torchtitan`` DCP export, the way
torchtitan's checkpointer loads (run as a subprocess by tests/huggingface/test_hf_client.py).

The model is built as torchtitan's llama3 package builds its flavors, with the shape of the Hugging
Face config beside the checkpoint (norm eps and rotary base too, rotary scaling off as in that
config). The optimizer is torch AdamW over the model's parameters in the Trainer's two groups (under
torchtitan's names), with torchtitan's LambdaLR made before the load, as its trainer does. The load
is its checkpointer's: ``{**model.state_dict(), "optimizer": get_flat_optim_state_dict(opt)}`` ->
``dcp.load`` -> ``load_state_dict`` / ``load_flat_optim_state_dict``.

The reference is torchtitan's own conversion: its state-dict adapter's ``from_hf`` applied to the
Universal Checkpoint's fp32 weights (and to each Adam moment, loaded into a scratch model whose
load hook fuses q, k and v). Written to OUT: whether every parameter and moment is bit-equal to it,
the steps, the groups, and the logits of the torchtitan model and of the Hugging Face model
holding the same weights on one batch.

    python tests/workers/torchtitan_worker.py CONFIG_DIR EXPORT UNIVERSAL BATCH.pt OUT.pt
"""

import re
import sys
import types
from pathlib import Path

import torch


def stub_triton_kernels() -> None:
    """torchtitan 0.3.0 imports its expert-parallel Triton kernels (``minimal_async_ep/kernels.py``,
    which imports triton) whatever model is built; the Llama3 model never runs them. A stand-in for
    that one module spares a CPU machine a 1 GB GPU compiler (a stand-in triton itself would make
    torch believe it has one)."""
    kernels = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")

    def absent(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None

    kernels.__getattr__ = absent
    sys.modules.setdefault(kernels.__name__, kernels)


def universal(folder: Path, name: str, state: str, shape) -> torch.Tensor:
    t = torch.load(folder / "zero" / name / f"{state}.pt", weights_only=True)
    t = t["param"] if isinstance(t, dict) else t
    return t.reshape(shape) if shape is not None else t


def build(hf: dict):
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers,
                                          _output_linear_init)
    from torchtitan.models.llama3.model import Llama3Model

    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or dim // heads
    layers = _build_llama3_layers(n_layers=hf["num_hidden_layers"], dim=dim, n_heads=heads,
                                  n_kv_heads=hf["num_key_value_heads"], hidden_dim=hf["intermediate_size"],
                                  rope=ComplexRoPE.Config(dim=head_dim, max_seq_len=hf["max_position_embeddings"],
                                                          theta=hf.get("rope_theta", 10000.0), scaling="none"),
                                  attn_backend="flex")
    eps = hf["rms_norm_eps"]
    for layer in layers:
        layer.attention_norm.eps = layer.ffn_norm.eps = eps
    config = Llama3Model.Config(dim=dim, vocab_size=hf["vocab_size"],
                                tok_embeddings=Embedding.Config(num_embeddings=hf["vocab_size"], embedding_dim=dim,
                                                                param_init=_EMBEDDING_INIT),
                                norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT, eps=eps),
                                lm_head=Linear.Config(in_features=dim, out_features=hf["vocab_size"],
                                                      param_init=_output_linear_init(dim)),
                                layers=layers, enable_weight_tying=bool(hf.get("tie_word_embeddings")))
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_states(buffer_device=torch.device("cpu"))
    return config, model


def main() -> None:
    import json

    import torch.distributed.checkpoint as dcp
    from torchtitan.components.optimizer.utils import (get_flat_optim_state_dict, init_optim_state,
                                                       load_flat_optim_state_dict)
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer

    config_dir, export, uni, batch, out = sys.argv[1:6]
    uni = Path(uni)
    hf_config = json.loads((Path(config_dir) / "config.json").read_text())
    torch.manual_seed(0)
    config, model = build(hf_config)
    hf_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    hf_names = [n for n, _ in hf_model.named_parameters()]
    decay = set(Trainer.get_decay_parameter_names(None, hf_model))
    adapter = Llama3StateDictAdapter(config, None)

    # the Trainer's two groups under torchtitan's parameter names (its adapter's map; q, k and v are
    # the one fused wqkv parameter)
    def tt_param(name):
        layer = re.search(r"\d+", name)
        new = adapter.from_hf_map[re.sub(r"(\d+)", "{}", name, count=1)]
        new = new.format(layer.group(0)) if layer else new
        return re.sub(r"qkv_linear\.w[qkv]\.", "qkv_linear.wqkv.", new)
    tt_decay = {tt_param(n) for n in hf_names if n in decay}
    named = list(model.named_parameters())
    # (name, parameter) pairs, as torchtitan builds its optimizers: its flat state dict keys by them
    opt = torch.optim.AdamW([{"params": [(n, p) for n, p in named if n in tt_decay], "weight_decay": 0.1},
                             {"params": [(n, p) for n, p in named if n not in tt_decay], "weight_decay": 0.0}],
                            lr=5e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    init_optim_state(opt)
    model_keys = list(model.state_dict())
    sd = {**model.state_dict(), "optimizer": get_flat_optim_state_dict(opt)}
    dcp.load(sd, checkpoint_id=export)
    model.load_state_dict({k: sd[k] for k in model_keys}, strict=True)
    load_flat_optim_state_dict(opt, sd["optimizer"])
    # as loaded (the next scheduler step sets lr from torchtitan's own schedule, whose base is its config's)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]

    # torchtitan's own conversion of the same state
    shapes = {n: p.shape for n, p in hf_model.named_parameters()}
    ref_model = build(hf_config)[1]
    ref_model.load_state_dict(adapter.from_hf({n: universal(uni, n, "fp32", s) for n, s in shapes.items()}),
                              strict=True)
    ok = {}
    for (n, p), (rn, rp) in zip(model.named_parameters(), ref_model.named_parameters()):
        ok[f"param {n}"] = n == rn and torch.equal(p.detach().view(torch.int32), rp.detach().view(torch.int32))
    moments = {}
    for key in ("exp_avg", "exp_avg_sq"):
        scratch = build(hf_config)[1]
        scratch.load_state_dict(adapter.from_hf({n: universal(uni, n, key, s) for n, s in shapes.items()}),
                                strict=True)
        moments[key] = dict(scratch.named_parameters())
    for n, p in named:
        st = opt.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            ok[f"{key} {n}"] = torch.equal(st[key].view(torch.int32), moments[key][n].detach().view(torch.int32))
    steps = {n: float(opt.state[p]["step"]) for n, p in named}
    with torch.no_grad():
        for n, p in hf_model.named_parameters():
            p.copy_(universal(uni, n, "fp32", p.shape))
    ids = torch.load(batch, weights_only=True)
    model.eval()
    with torch.no_grad():
        pos = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
        tt_logits = model(ids, pos, model.get_attention_masks(pos))
        hf_logits = hf_model(input_ids=ids).logits
    # The resumed optimizer takes a step. The gradients are set by hand: torch 2.13 has no CPU backward
    # for FlexAttention, the attention torchtitan's Llama3 builds for language models.
    for _, p in named:
        p.grad = torch.full_like(p, 1e-3)
    before = {n: p.detach().clone() for n, p in named}
    opt.step()
    scheduler.step()
    moved = all(not torch.equal(before[n], p.detach()) for n, p in named)
    torch.save({"ok": ok, "steps": steps,
                "groups": groups,
                "group_sizes": [len(g["params"]) for g in opt.param_groups], "decay_count": len(tt_decay),
                "tt_logits": tt_logits, "hf_logits": hf_logits, "moved": moved,
                "steps_after": {n: float(opt.state[p]["step"]) for n, p in named}}, out)


if __name__ == "__main__":
    stub_triton_kernels()
    main()
