"""DeepSpeed's pickled objects (loss scaler, fragment addresses, the ZeRO stage enum, Adam's param
groups), written under their global names without importing DeepSpeed."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..formats.pickle_read import Opaque, OpaqueEnum


DS_VERSION = "0.19.8"
# The run the files describe: one step at micro-batch 1. Read at use time (records.GLOBAL_STEPS), so
# that a test mirroring another run's counters can set them here.
GLOBAL_STEPS = 1
MICRO_BATCH = 1
LR = 1e-2

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
