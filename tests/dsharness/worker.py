"""What the DeepSpeed ranks run.

Usage: python worker.py JOB.json

One invocation is one "launch": a supervisor process imports torch and DeepSpeed once and then
forks `world_size` ranks, which saves the ~1-2 s of interpreter + torch import that every rank
would otherwise pay (on 2 cores, 4 ranks importing in parallel cost ~4 s of wall time). The
supervisor itself never runs a torch op, so no OpenMP/intra-op thread pool exists at fork time.

Each rank runs the job's tasks in order, all inside one process group, so several checkpoint
configurations with the same world size share one launch. Rank 0 writes each task's result
dict with torch.save; the parent test process reads it back.
"""

import time

START = time.perf_counter()

import datetime  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

# The worker is started as a script, not as a package module, so its sibling must be found by path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402
import deepspeed  # noqa: E402
from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

import models  # noqa: E402

OPTIM_KEYS = ("exp_avg", "exp_avg_sq")
# DeepSpeed's name for the per-parameter AutoTP layout dict (checkpoint/constants.py DS_AUTOTP_UC_META).
AUTOTP_META = "ds_autotp_universal_checkpoint_meta"

# Merged in front of the "llama" preset's specs (use_default_specs): the fused projections of
# models.TinyLlama's layer 1 as sub-parameters, and the lm_head as a column-parallel layer whose
# output is gathered (the preset alone leaves lm_head and the embedding replicated). The lm_head
# spec is what produces vocabulary_parameter_patterns / original_vocab_size. Q and K/V rows are
# 16 / 8 / 8 in both llama variants.
_Q_ROWS = models.LlamaConfig.num_attention_heads * models.LlamaConfig.head_dim
_KV_ROWS = models.LlamaConfig.num_key_value_heads * models.LlamaConfig.head_dim
AUTOTP_EXTRA_SPECS = [
    {
        "patterns": [r".*\.self_attn\.qkv_proj\.weight$"],
        "partition_type": "column",
        "shape": [[_Q_ROWS, _KV_ROWS, _KV_ROWS], -1],
        "partition_dim": 0,
    },
    {
        "patterns": [r".*\.mlp\.gate_up_proj\.weight$"],
        "partition_type": "column",
        "shape": [2, -1],
        "partition_dim": 0,
    },
    {
        "patterns": [r"^lm_head\.weight$"],
        "partition_type": "column",
        "gather_output": True,
    },
]


def skip_shm_comm_op() -> None:
    """Stop DeepSpeed from JIT-compiling its shared-memory comm op.

    On the CPU accelerator, every TorchBackend construction (deepspeed.init_distributed) calls
    build_shm_op(), which ninja-compiles deepspeed_shm_comm into TORCH_EXTENSIONS_DIR: ~35 s on
    2 cores, per fresh extensions dir, and it needs a C++ compiler. The op only backs
    inference_all_reduce; training, ZeRO and checkpointing use torch.distributed (gloo).
    build_shm_op() skips the build when deepspeed.ops.__compatible_ops__ says the op is not
    compatible; that dict is computed lazily on first access (probing every op, which can run
    compiler subprocesses too), so pre-seeding it skips the probing as well. Nothing else in
    DeepSpeed 0.19.8 reads it.
    """
    if os.environ.get("DSHARNESS_BUILD_SHM_OP") == "1":
        return
    import deepspeed.ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS
    deepspeed.ops.__compatible_ops__ = dict.fromkeys(ALL_OPS, False)


def warm_up() -> None:
    """Import, once in the supervisor, what DeepSpeed otherwise imports lazily in every rank.

    The first deepspeed.initialize() in a process spends ~2 s importing torch._dynamo and
    inductor (torch.optim.Optimizer.__init__ and DeepSpeed's Muon module touch them) and the
    ZeRO optimizers; doing it before the fork makes that a one-time cost per launch instead of
    per rank. Only module imports happen here: no threads exist yet at fork time.
    """
    import deepspeed.runtime.engine  # noqa: F401
    import deepspeed.runtime.bf16_optimizer  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
    import deepspeed.runtime.zero.stage3  # noqa: F401
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    import deepspeed.module_inject.auto_ep  # noqa: F401
    import deepspeed.module_inject.auto_ep_layer  # noqa: F401
    import deepspeed.module_inject.auto_tp  # noqa: F401
    import deepspeed.module_inject.layers  # noqa: F401
    import torch._dynamo  # noqa: F401


def tp_of(cfg: dict) -> int:
    """The AutoTP degree; 1 (None, or 1) means no AutoTP at all (DeepSpeed skips it below 2)."""
    return cfg.get("tp_size") or 1


def ds_config(cfg: dict, world_size: int, load_universal: bool = False) -> dict:
    zero = {"stage": cfg["stage"]}
    if cfg["stage"] == 3 and cfg.get("sub_group_size"):
        zero["sub_group_size"] = cfg["sub_group_size"]
    if cfg.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
        if cfg["stage"] == 3:
            zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": models.MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "train_batch_size": models.MICRO_BATCH * world_size,
        # torch_adam avoids DeepSpeed's FusedAdam/CPUAdam, both of which need a compiled op;
        # "Adam" would silently become torch.optim.AdamW unless adam_w_mode is switched off.
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-2,
                "torch_adam": True,
                "adam_w_mode": False
            }
        },
        "zero_optimization": zero,
        "steps_per_print": 1_000_000,
    }
    if cfg["dtype"] == "bf16":
        config["bf16"] = {"enabled": True}
    elif cfg["dtype"] != "fp32":
        raise ValueError(f"unsupported dtype {cfg['dtype']!r}")
    if cfg.get("grad_accum_dtype"):
        config["data_types"] = {"grad_accum_dtype": cfg["grad_accum_dtype"]}
    if cfg["model"] == "moe":
        # use_grouped_mm=false selects GroupedExperts' per-expert loop: torch._grouped_mm and the
        # Triton kernel are GPU-only.
        config["expert_parallel"] = {
            "enabled": True,
            "autoep_size": cfg["ep_size"],
            "preset_model": "mixtral",
            "use_grouped_mm": False,
            "disable_triton_grouped_mm": True,
        }
        config["use_data_before_expert_parallelism"] = bool(cfg["use_data_before_expert_parallelism"])
    if tp_of(cfg) > 1:
        # No train_batch_size under AutoTP: DeepSpeedConfig checks it against micro *
        # accumulation * "world size", which is dist.get_world_size() (4) when initialize()
        # parses the config but the data-parallel size (2) when ZeRO-3's zero.Init re-parses it
        # with the TP mpu. No value satisfies both; left out, each derives its own.
        del config["train_batch_size"]
        config["tensor_parallel"] = {
            "autotp_size": tp_of(cfg),
            "preset_model": "llama",
            "partition_config": {
                "use_default_specs": True,
                "layer_specs": AUTOTP_EXTRA_SPECS
            },
        }
    if cfg.get("lr_scheduler"):
        # Linear warm-up over 4 steps, then linear decay: the lr differs at every step a test takes
        # (3 before the save, one after the load). A list gives each group of Config.groups its own.
        top = [1e-2, BIAS_GROUP["lr"]] if cfg.get("groups") else 1e-2
        config["scheduler"] = {
            "type": "WarmupDecayLR",
            "params": {
                "total_num_steps": 20,
                "warmup_num_steps": 4,
                "warmup_type": "linear",
                "warmup_max_lr": top,
                "warmup_min_lr": [lr / 10 for lr in top] if isinstance(top, list) else top / 10,
            },
        }
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    return config


def client_payload() -> dict:
    """Config.client_payload's client_state["trainer"]: what a training script keeps beside its
    checkpoint, of every kind torch's weights-only reader rebuilds (a load must return it as saved)."""
    return {
        "epoch": 2,
        "samples_seen": 1 << 40,
        "best_loss": 0.8125,
        "lr_history": [1e-3, 3.25e-3, -0.0, float("inf")],
        "run": {"name": "dsharness", "tags": ["tiny", "ckpt"], "resumed": False, "parent": None, "grid": (3, 4)},
        "rng": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "ema": torch.tensor([0.5, -1.25, 3.0], dtype=torch.bfloat16),
        "empty": {"list": [], "tensor": torch.zeros(0, 2)},
    }


def reset_expert_groups() -> None:
    """Forget the EP/expert-DP groups a previous task of this launch created.

    deepspeed.utils.groups caches them per name ("ep_size_2") for the life of the process and
    reuses a cached one even when the next engine asks for the other rank order
    (use_data_before_expert_parallelism). And the ZeRO-1/2 universal loader takes its EP rank
    and size from the group with the *largest* cached ep size (_get_max_expert_size_name): an
    ep-1 load after an ep-2 task in the same launch failed with "Invalid AutoEP universal
    checkpoint target metadata: target ep_rank 1 does not match parameter metadata ep_rank 0".
    engine.destroy() clears none of this. The abandoned gloo groups stay alive; that costs
    nothing that matters here.
    """
    for cache in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                  groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
        cache.clear()


def reset_tp_groups() -> None:
    """Forget the TP/DP groups a previous task of this launch created.

    groups._init_tp_mesh_device returns early once _TENSOR_MODEL_PARALLEL_GROUP is set, so a
    tp-4 engine after a tp-2 one in the same process would silently run on the tp-2 groups; and
    the engine publishes itself through groups.mpu, which later non-TP engines would read as
    their data-parallel topology. engine.destroy() clears neither.
    """
    groups._TENSOR_MODEL_PARALLEL_GROUP = None
    groups._MODEL_PARALLEL_GROUP = None
    groups._DATA_PARALLEL_GROUP = None
    groups._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = None
    groups._MPU_TENSOR_MODEL_PARALLEL_RANK = None
    groups.mpu = None


def data_rank(cfg: dict, rank: int) -> int:
    """Data-parallel rank: AutoTP lays ranks out as a (dp, tp) mesh, TP groups being blocks of
    tp consecutive ranks (checked against DeepSpeed's groups in check_autotp_start)."""
    return rank // tp_of(cfg)


def autotp_layout(param) -> dict | None:
    """The layout AutoTP recorded on a parameter, or None where it left the parameter alone."""
    meta = getattr(param, AUTOTP_META, None)
    if not meta:
        return None
    keys = ("partition_type", "partition_dim", "logical_shape", "original_shape", "partition_sizes",
            "sub_param_sizes", "sub_param_shard_widths", "replicated", "is_bias")
    out = {k: meta.get(k) for k in keys}
    for k in ("logical_shape", "original_shape", "partition_sizes", "sub_param_sizes"):
        if out[k] is not None:
            out[k] = [int(v) for v in out[k]]
    if out["sub_param_shard_widths"] is not None:
        out["sub_param_shard_widths"] = [[int(v) for v in w] for w in out["sub_param_shard_widths"]]
    return out


def gather_tp(local: torch.Tensor, layout: dict | None, what: str) -> torch.Tensor:
    """The whole (logical-shape) tensor from each TP rank's shard, using the layer's own record
    of how it cut the parameter.

    A shard holds, along partition_dim, this rank's piece of every sub-parameter in turn
    (one sub-parameter = the whole dimension for a plain split); widths[s][r] is rank r's piece
    of sub-parameter s. Shards travel through all_gather_object because their shapes differ
    (uneven and even zero-width shards). Parameters AutoTP left whole, or marked replicated,
    must be bit-identical on every TP rank: DeepSpeed's converter asserts the same.
    """
    group = groups.get_tensor_model_parallel_group()
    tp = tdist.get_world_size(group)
    items = [None] * tp
    tdist.all_gather_object(items, local, group=group)
    if layout is None or layout["replicated"] or layout["partition_dim"] is None:
        for r, t in enumerate(items[1:], 1):
            if not torch.equal(items[0], t):
                raise RuntimeError(f"{what}: replicated on the TP group but TP rank {r} differs from rank 0")
        return items[0]
    pd = layout["partition_dim"]
    widths = layout["sub_param_shard_widths"] or [layout["partition_sizes"]]
    views = []
    for r, t in enumerate(items):
        shape = list(layout["logical_shape"])
        shape[pd] = sum(w[r] for w in widths)
        views.append(t.reshape(shape))
    pieces, offsets = [], [0] * tp
    for w in widths:
        for r in range(tp):
            pieces.append(views[r].narrow(pd, offsets[r], w[r]))
            offsets[r] += w[r]
    return torch.cat(pieces, dim=pd).reshape(layout["original_shape"])


def empty_tp_shard(p) -> torch.Tensor | None:
    """An fp32 stand-in for a zero-numel TP shard (tp > KV heads: ranks holding no head).

    ZeRO tracks no state for such a parameter: ZeRO-1/2 give it no fragment mapping, so
    safe_get_full_* return None; ZeRO-3 leaves it out of grad_position, so they raise KeyError.
    Both DP peers of a TP rank hold the same (empty) shape, so skipping the DP collective is
    consistent across the DP group.
    """
    shape = tuple(getattr(p, "ds_shape", p.shape))
    return torch.empty(shape, dtype=torch.float32) if math.prod(shape) == 0 else None


def local_fp32(p) -> torch.Tensor:
    empty = empty_tp_shard(p)
    return empty if empty is not None else safe_get_full_fp32_param(p)


def local_moment(p, key: str) -> torch.Tensor:
    empty = empty_tp_shard(p)
    return empty if empty is not None else safe_get_full_optimizer_state(p, key)


def check_autotp_start(engine, cfg: dict, sources: dict, rank: int, world_size: int) -> None:
    """Before any step: DeepSpeed's TP/DP groups are the (dp, tp) mesh data_rank assumes, and
    gathering every parameter's TP shards (gather_tp) gives back exactly the unsharded source
    weights (in the model dtype). That makes the reference's gather independent evidence, not
    a restatement of DeepSpeed's own layout code. Collective.
    """
    tp = tp_of(cfg)
    tp_group, dp_group = groups.get_tensor_model_parallel_group(), groups.get_data_parallel_group()
    if (tdist.get_world_size(tp_group), tdist.get_rank(tp_group)) != (tp, rank % tp):
        raise RuntimeError(f"rank {rank}: TP group rank/size {tdist.get_rank(tp_group)}/"
                           f"{tdist.get_world_size(tp_group)}, expected {rank % tp}/{tp}")
    if (tdist.get_world_size(dp_group), tdist.get_rank(dp_group)) != (world_size // tp, data_rank(cfg, rank)):
        raise RuntimeError(f"rank {rank}: DP group rank/size {tdist.get_rank(dp_group)}/"
                           f"{tdist.get_world_size(dp_group)}, expected {data_rank(cfg, rank)}/{world_size // tp}")
    dtype = torch.bfloat16 if cfg["dtype"] == "bf16" else torch.float32
    names = [n for n, _ in engine.module.named_parameters()]
    if names != list(sources):
        raise RuntimeError(f"AutoTP changed the parameter names: {names} != {list(sources)}")
    for name, p in engine.module.named_parameters():
        got = gather_tp(local_fp32(p).detach().cpu(), autotp_layout(p), f"fp32/{name}")
        if not torch.equal(got, sources[name].to(dtype).float()):
            raise RuntimeError(f"rank {rank}: TP-gathered {name} {tuple(got.shape)} is not the source weight")


def autoep_layers(module):
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    return [(name, m) for name, m in module.named_modules() if isinstance(m, AutoEPMoELayer)]


def expected_ep_rank(cfg: dict, rank: int, world_size: int) -> int:
    """EP rank of a global rank (tp = pp = 1), as groups._create_expert_and_data_parallel lays it out.

    E+D (default): EP groups are blocks of ep consecutive ranks. D+E: EP group i is
    range(i, world, world // ep), so the EP rank is the block index.
    """
    ep = cfg["ep_size"]
    return rank // (world_size // ep) if cfg["use_data_before_expert_parallelism"] else rank % ep


def check_autoep_start(engine, cfg: dict, sources: dict, world_size: int) -> None:
    """Before any step: each AutoEP layer sits at the expected EP rank and its fp32 masters are
    exactly the source experts [ep_rank * n_local, (ep_rank + 1) * n_local).

    This pins the meaning of "global expert id = ep_rank * num_local + local index" to the
    experts' origin, so the reference built from it (gather_state) is in true global order.
    Collective (safe_get_full_fp32_param).
    """
    dtype = torch.bfloat16 if cfg["dtype"] == "bf16" else torch.float32
    rank = tdist.get_rank()
    layers = autoep_layers(engine.module)
    if [name for name, _ in layers] != list(sources):
        raise RuntimeError(f"AutoEP replaced {[n for n, _ in layers]}, expected {list(sources)}")
    for name, layer in layers:
        if layer.ep_size != cfg["ep_size"] or layer.ep_rank != expected_ep_rank(cfg, rank, world_size):
            raise RuntimeError(f"rank {rank}: {name} has ep_rank {layer.ep_rank}/{layer.ep_size}, expected "
                               f"{expected_ep_rank(cfg, rank, world_size)}/{cfg['ep_size']}")
        gate_up, down = sources[name]
        nl = layer.num_local_experts
        lo, hi = layer.ep_rank * nl, (layer.ep_rank + 1) * nl
        ffn = down.shape[2]
        expected = {"w1": gate_up[lo:hi, :ffn], "w2": down[lo:hi], "w3": gate_up[lo:hi, ffn:]}
        for w, want in expected.items():
            got = safe_get_full_fp32_param(getattr(layer.experts, w)).detach().cpu()
            # The fp32 master starts as the model-dtype weight, so bf16 runs start from rounded values.
            if not torch.equal(got, want.to(dtype).float()):
                raise RuntimeError(f"rank {rank}: {name}.experts.{w} does not hold source experts [{lo}, {hi})")


BIAS_GROUP = models.BIAS_GROUP


def make_engine(cfg: dict, world_size: int, load_universal: bool = False):
    reset_expert_groups()
    reset_tp_groups()
    model = models.build_model(cfg["model"])
    tp_sources = None
    if tp_of(cfg) > 1:
        tp_sources = {n: p.detach().clone() for n, p in model.named_parameters()}
        # Lazy, for the same reason as under AutoEP: parameters AutoTP replaces (rather than
        # re-slicing in place) must be taken after the replacement.
        trainable = (p for p in model.parameters() if p.requires_grad)
    elif cfg["model"] == "moe":
        sources = {
            f"model.layers.{i}.mlp": (layer.mlp.experts.gate_up_proj.detach().clone(),
                                      layer.mlp.experts.down_proj.detach().clone())
            for i, layer in enumerate(model.model.layers)
        }
        # A lazy iterable: AutoEP swaps the MoE blocks inside initialize() before consuming it,
        # so it yields the replacement parameters. A list would hold the discarded source ones
        # and rely on DeepSpeed's source-to-replacement remap (not tried).
        trainable = (p for p in model.parameters() if p.requires_grad)
    elif cfg.get("groups"):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        trainable = [{"params": [p for n, p in named if not n.endswith(".bias")]},
                     {"params": [p for n, p in named if n.endswith(".bias")], **BIAS_GROUP}]
    else:
        trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=trainable,
                                           config=ds_config(cfg, world_size, load_universal))
    if cfg["model"] == "moe":
        check_autoep_start(engine, cfg, sources, world_size)
    if tp_sources is not None:
        check_autotp_start(engine, cfg, tp_sources, tdist.get_rank(), world_size)
    return engine


def train_step(engine, cfg: dict, rank: int, step: int) -> float:
    dtype = torch.bfloat16 if cfg["dtype"] == "bf16" else torch.float32
    loss = engine(*models.batch(cfg["model"], data_rank(cfg, rank), step, dtype))
    engine.backward(loss)
    engine.step()
    value = loss.item()
    if not math.isfinite(value):
        raise RuntimeError(f"rank {rank}: non-finite loss {value} at step {step}")
    return value


def optimizer_step(engine):
    """The Adam step count, which ZeRO keeps once per flat group; all of them must agree."""
    steps = set()
    for state in engine.optimizer.optimizer.state.values():
        if "step" in state:
            s = state["step"]
            steps.add(s.item() if torch.is_tensor(s) else s)
    if len(steps) != 1:
        raise RuntimeError(f"expected one optimizer step value, got {sorted(steps)}")
    return steps.pop()


def relink_optimizer_fragments(engine) -> None:
    """Work around DeepSpeed 0.19.8 leaving later ZeRO-1/2 param groups without moment views.

    DeepSpeedZeroOptimizer steps one param group at a time (_optimizer_step(i)) and, after the
    *first* group's step, links every group's params to their slices of the torch optimizer
    state once (_lazy_init_hp_params_optimizer_state, then _hp_optimizer_states_linked = True).
    torch Adam creates a group's state lazily in its own step, so groups 1.. get linked to an
    empty state and safe_get_full_optimizer_state raises "exp_avg not found in optimizer state
    fragment" for their params. MoE models always have a second group (the experts). Linking
    again once every group has stepped only recomputes the views.
    """
    opt = engine.optimizer
    if getattr(opt, "_hp_optimizer_states_linked", False) and hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def gather_experts(local: torch.Tensor, layer, what: str) -> torch.Tensor:
    """All experts of one AutoEP tensor, [num_experts, ...] in global expert order.

    `local` is this rank's [num_local, ...] (safe_get_full_* gather only over the expert-DP
    group). Every rank contributes (its layer's ep_rank, local); EP rank r holds global experts
    r*num_local .. (r+1)*num_local-1 (check_autoep_start proved that). Ordering by the reported
    ep_rank rather than by position in some group keeps this right for both rank orders
    (use_data_before_expert_parallelism), and the expert-DP replicas of one EP rank must agree
    bit for bit.
    """
    items = [None] * tdist.get_world_size()
    tdist.all_gather_object(items, (layer.ep_rank, local))
    by_ep = {}
    for rank, (ep_rank, t) in enumerate(items):
        if ep_rank in by_ep and not torch.equal(by_ep[ep_rank], t):
            raise RuntimeError(f"{what}: expert-DP replicas of EP rank {ep_rank} disagree (rank {rank})")
        by_ep.setdefault(ep_rank, t)
    if sorted(by_ep) != list(range(layer.ep_size)):
        raise RuntimeError(f"{what}: EP ranks {sorted(by_ep)} reported, expected 0..{layer.ep_size - 1}")
    return torch.cat([by_ep[r] for r in range(layer.ep_size)])


def gather_state(engine) -> dict:
    """Full (unpartitioned) fp32 masters and Adam moments for every parameter.

    Collective under every stage (all-reduce for ZeRO-1/2, all-gather for ZeRO-3), so all
    ranks must call it in the same order; named_parameters() order is identical on all ranks.
    AutoEP expert tensors come back with all experts (gather_experts), not just the local ones.
    """
    stage3 = engine.zero_optimization_partition_weights()
    relink_optimizer_fragments(engine)
    module = engine.module
    fp32 = {}
    moments = {k: {} for k in OPTIM_KEYS}
    names, frozen = [], []
    layers = autoep_layers(module)
    expert_of = {id(getattr(layer.experts, w)): layer for _, layer in layers for w in ("w1", "w2", "w3")}
    tp = groups.get_tensor_model_parallel_world_size() if groups._TENSOR_MODEL_PARALLEL_GROUP is not None else 1
    layouts = {}
    # named_parameters() yields a tied tensor once, under the name it was first registered as.
    for name, p in module.named_parameters():
        names.append(name)
        if p.requires_grad:
            fp32[name] = local_fp32(p).detach().cpu().clone()
            for k in OPTIM_KEYS:
                moments[k][name] = local_moment(p, k).detach().cpu().clone()
            if tp > 1:
                # safe_get_full_* assemble the data-parallel partitions of this rank's TP shard.
                layouts[name] = autotp_layout(p)
                fp32[name] = gather_tp(fp32[name], layouts[name], f"fp32/{name}")
                for k in OPTIM_KEYS:
                    moments[k][name] = gather_tp(moments[k][name], layouts[name], f"{k}/{name}")
            layer = expert_of.get(id(p))
            if layer is not None:
                fp32[name] = gather_experts(fp32[name], layer, f"fp32/{name}")
                for k in OPTIM_KEYS:
                    moments[k][name] = gather_experts(moments[k][name], layer, f"{k}/{name}")
        else:
            # A frozen parameter has no master copy; its module value (exact in fp32) is the
            # only state there is.
            frozen.append(name)
            if stage3:
                with deepspeed.zero.GatheredParameters([p]):
                    fp32[name] = p.data.detach().float().cpu().clone()
            else:
                fp32[name] = p.detach().float().cpu().clone()
    buffers = {name: b.detach().cpu().clone() for name, b in module.named_buffers()}
    meta_extra = {}
    if layers:
        ep_ranks = [None] * tdist.get_world_size()
        tdist.all_gather_object(ep_ranks, layers[0][1].ep_rank)
        meta_extra = {
            "ep_size": layers[0][1].ep_size,
            "ep_rank_of_rank": ep_ranks,
            "num_experts": layers[0][1].num_experts,
            "autoep_layers": [name for name, _ in layers],
            "expert_params": [f"{name}.experts.{w}" for name, _ in layers for w in ("w1", "w2", "w3")],
        }
    if tp > 1:
        # Rank 0's record per parameter (partition_sizes and shard widths list every TP rank) and
        # rank 0's shard shapes.
        meta_extra["autotp_layouts"] = layouts
        meta_extra["local_shapes"] = {n: list(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()}
    return {
        "fp32": fp32,
        "exp_avg": moments["exp_avg"],
        "exp_avg_sq": moments["exp_avg_sq"],
        "step": optimizer_step(engine),
        "param_names": names,
        "frozen": frozen,
        "buffers": buffers,
        "meta": {
            "optimizer_class": type(engine.optimizer).__name__,
            "base_optimizer_class": type(engine.optimizer.optimizer).__name__,
            "global_steps": engine.global_steps,
            "world_size": tdist.get_world_size(),
            # The universal loader overwrites the live param-group keys (names included) with the
            # saved ones, so these show what it did; see NOTES.md "AutoEP".
            "param_group_names": [g.get("name") for g in engine.optimizer.optimizer.param_groups],
            "tp_size": tp,
            **meta_extra,
        },
    }


def state_after_load(engine) -> dict:
    """gather_state of an engine right after its load_checkpoint, before any step.

    ZeRO-1/2 link each parameter's fragment to its slice of the Adam moments at the first step
    (_lazy_init_hp_params_optimizer_state, then _hp_optimizer_states_linked = True); a state read
    before any step, as right after a load, needs them linked now.
    """
    opt = engine.optimizer
    if getattr(opt, "_hp_optimizer_states_linked", True) is False:
        opt._lazy_init_hp_params_optimizer_state()
    return gather_state(engine)


def resume(engine, load_dir, tag=None) -> tuple:
    """engine.load_checkpoint(load_dir, tag=tag) and the state it left: (state, load path, client state)."""
    path, client = engine.load_checkpoint(load_dir, tag=tag)
    return state_after_load(engine), path, client


def run_save(task: dict, rank: int, world_size: int) -> dict:
    cfg = task["cfg"]
    engine = make_engine(cfg, world_size)
    engine.train()
    losses = [train_step(engine, cfg, rank, step) for step in range(cfg["steps"])]
    # MoE/AutoEP saves write universal_checkpoint_info themselves and reject it in client_state
    # (KeyError: reserved checkpoint keys). AutoTP writes it too (module.universal_checkpoint_info),
    # and there client_state would silently win: engine._save_checkpoint applies it last
    # (state.update(client_state)), so an empty dict would replace AutoTP's pattern lists.
    own_uc_info = cfg["model"] == "moe" or tp_of(cfg) > 1
    client_state = {"universal_checkpoint_info": {}} if cfg["uc_info"] and not own_uc_info else {}
    if cfg.get("client_payload"):
        client_state["trainer"] = client_payload()
    engine.save_checkpoint(task["root"], client_state=client_state)
    state = gather_state(engine)
    state["tag"] = f"global_step{engine.global_steps}"
    state["meta"]["losses"] = losses
    engine.destroy()
    return state


def run_load(task: dict, rank: int, world_size: int) -> dict:
    cfg = task["cfg"]
    engine = make_engine(cfg, world_size, load_universal=True)
    load_path, _ = engine.load_checkpoint(task["universal_root"], tag=task["tag"])
    if load_path is None:
        raise RuntimeError(f"load_checkpoint found nothing under {task['universal_root']} tag {task['tag']}")
    state = gather_state(engine)
    # The restored state must also be trainable: one more step, loss checked in train_step.
    engine.train()
    state["meta"]["loss_after_load"] = train_step(engine, cfg, rank, engine.global_steps)
    engine.destroy()
    return state


def run_fail(task: dict, rank: int, world_size: int) -> dict:
    """Harness self-test: one rank dies while the others wait in a collective."""
    if rank == task["rank"]:
        raise RuntimeError(f"deliberate failure on rank {rank}")
    tdist.barrier()
    return {}


_CALL_MODULES: dict = {}


def call_module(path: str):
    """The module at file `path`, imported once per process (the supervisor imports it before the
    fork, so its imports are paid once per launch rather than once per rank)."""
    if path not in _CALL_MODULES:
        import importlib.util
        name = "dsharness_call_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _CALL_MODULES[path] = module
    return _CALL_MODULES[path]


def run_call(task: dict, rank: int, world_size: int) -> dict:
    """A task another test file defines: `getattr(<module at task["module"]>, task["function"])(task,
    rank, world_size)`, run in every rank inside the launch's process group; rank 0's returned dict
    (tensors, numbers, strings, plain containers) is the task's result."""
    return getattr(call_module(task["module"]), task["function"])(task, rank, world_size)


def run_rank(job: dict, rank: int) -> None:
    world_size = job["world_size"]
    os.environ.update({
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "LOCAL_SIZE": str(world_size),
    })
    # A file store instead of MASTER_PORT: nothing to collide with when launches overlap.
    tdist.init_process_group("gloo",
                             init_method="file://" + job["store"],
                             rank=rank,
                             world_size=world_size,
                             timeout=datetime.timedelta(seconds=job["timeout_s"]))
    deepspeed.init_distributed(dist_backend="gloo")
    for task in job["tasks"]:
        t0 = time.perf_counter()
        run = {"save": run_save, "load": run_load, "fail": run_fail, "call": run_call}[task["kind"]]
        state = run(task, rank, world_size)
        state.setdefault("meta", {})["seconds"] = time.perf_counter() - t0
        tdist.barrier()
        if rank == 0:
            torch.save(state, task["out"] + ".tmp")
            os.replace(task["out"] + ".tmp", task["out"])
    tdist.barrier()
    tdist.destroy_process_group()


def child(job: dict, rank: int) -> None:
    log = os.open(os.path.join(job["log_dir"], f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    # A gloo size mismatch aborts the process from C++ (SIGABRT); without this the rank log
    # would not say which Python line issued the collective.
    faulthandler.enable()
    code = 0
    try:
        run_rank(job, rank)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # _exit: the inherited interpreter state (atexit hooks, gloo threads) must not run twice.
    os._exit(code)


def supervise(job: dict) -> int:
    pids = {}
    for rank in range(job["world_size"]):
        pid = os.fork()
        if pid == 0:
            child(job, rank)
        pids[pid] = rank
    status = 0
    while pids:
        pid, wstatus = os.wait()
        rank = pids.pop(pid)
        code = os.waitstatus_to_exitcode(wstatus)
        if code != 0 and status == 0:
            status = 1
            print(f"rank {rank} exited with {code}; killing the other ranks", file=sys.stderr)
            # The surviving ranks would otherwise sit in a collective until the gloo timeout.
            for other in pids:
                os.kill(other, signal.SIGKILL)
    return status


def main() -> int:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    skip_shm_comm_op()
    t0 = time.perf_counter()
    warm_up()
    for task in job["tasks"]:
        if task["kind"] == "call":
            call_module(task["module"])
    t1 = time.perf_counter()
    status = supervise(job)
    # Phase timings for the launch log: where a launch's wall time goes.
    print(f"DSHARNESS-TIMING startup={t0 - START:.2f} warm_up={t1 - t0:.2f} ranks={time.perf_counter() - t1:.2f}")
    return status


if __name__ == "__main__":
    sys.exit(main())
