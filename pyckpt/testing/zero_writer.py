"""The files DeepSpeed 0.19.8's ``save_checkpoint`` writes for a model and a topology: ZeRO-1/2
(one model-state file, a shard per dp rank, AutoEP's per-expert files) and ZeRO-3 (a model-state
file and a shard per dp rank), as a plan the native executor runs.

One module, longer than most: each file kind's records follow from the same partitioning of the model
(DeepSpeed's flat groups, padding and dp fragments), computed once per checkpoint and read by all of them."""

from __future__ import annotations

import bisect
import hashlib
import math
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..formats.pickle_read import TorchSize
from ..planning.plan import Piece, Plan
from ..tensors import NewTensor
from .models import AUTOEP_PRESET, WEIGHTS, Model, MoELayer, ceil_to
from .noise import Flat, FlatStorage, Noise, Region, contiguous_stride, tensor, view
from . import records
from .records import DS_VERSION, LR, adam_param_group, fragment_address, loss_scaler, zero_stage_enum


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


class ZeroWriter:

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
            "train_micro_batch_size_per_gpu": records.MICRO_BATCH,
            "gradient_accumulation_steps": 1,
            "train_batch_size": records.MICRO_BATCH * self.topo.dp,
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
                strides = list(contiguous_stride(local))
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
            "buffer_names": self.buffer_names(),
            "optimizer": None,
            "param_shapes": self.param_shapes(groups),
            "frozen_param_shapes": None if stage1 else OrderedDict(),
            "shared_params": {},
            "frozen_param_fragments": None if stage1 else OrderedDict(),
            "lr_scheduler": None,
            "data_sampler": None,
            "random_ltd": None,
            "skipped_steps": 0,
            "global_steps": records.GLOBAL_STEPS,
            "global_samples": records.GLOBAL_STEPS * records.MICRO_BATCH * self.topo.dp,
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
            if self.m.buffers_before:
                raise NotImplementedError("buffers are written for AutoEP layouts only")
            # The bit16 params are views of one flat buffer padded to the ZeRO alignment, so
            # torch.save writes that whole buffer once.
            n = dense.numel()
            n_pad = ceil_to(n, 2 * dense.world)
            storage = FlatStorage(self.lp_dtype, n_pad, self.pad(self.lp(dense, t, 0, n, Flat()), n_pad - n,
                                                                 itemsize).pieces)
            for name, shape in dense.params:
                module[name] = view(storage, offsets[name], shape)
            return module
        # AutoEP's non-expert state dict holds each tensor in its own storage; experts are left out.
        for key, name in self.module_keys():
            if name is None:
                module[key] = self.buffer(key)
                continue
            flat = self.lp(dense, 0, offsets[name], math.prod(shapes[name]), Flat())
            module[key] = tensor(self.lp_dtype, shapes[name], flat)
        return module

    def module_keys(self):
        """(module key, parameter) for the non-expert state dict: each parameter, then its aliases; a
        buffer's key comes with parameter None, before the parameter Model.buffers_before names."""
        aliases_of: Dict[str, List[str]] = {}
        for alias, target in self.m.aliases.items():
            aliases_of.setdefault(target, []).append(alias)
        for name, _ in self.m.params:
            for key, _ in self.m.buffers_before.get(name, ()):
                yield key, None
            if name not in self.m.expert_layer:
                for key in [name] + aliases_of.get(name, []):
                    yield key, name

    def buffer_names(self) -> List[str]:
        return [key for name, _ in self.m.params for key, _ in self.m.buffers_before.get(name, ())]

    def buffer(self, key: str) -> NewTensor:
        """A buffer's float32 values: small, distinct and the same on every rank (buffers are not partitioned)."""
        shape = next(s for held in self.m.buffers_before.values() for k, s in held if k == key)
        n = math.prod(shape)
        seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little")
        values = [((seed + 7 * i) % 1000) / 4096.0 for i in range(n)]
        return NewTensor("float32", tuple(shape), [], False, struct.pack(f"<{n}f", *values))

    def zero12_shard(self, groups: List[Group], d: int, t: int = 0) -> dict:
        state, fp32_parts, paddings, mappings = {}, [], [], []
        for g in groups:
            content, r = g.content(self.topo, d)
            if not g.expert:
                content = t  # AutoEP and TP never meet (DeepSpeed refuses the pair), so 0 without tp
            n = g.numel()
            part = ceil_to(n, 2 * g.world) // g.world
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
                # buffers are not partitioned: each rank's file holds them whole
                module = OrderedDict((key, NewTensor(self.lp_dtype, (0, )) if name is not None else self.buffer(key))
                                     for key, name in self.module_keys())
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

