"""A ``*_model_states.pt`` file as a typed, validated record.

DeepSpeed's engine writes one per model-parallel rank (ZeRO-1/2: ``mp_rank_NN_model_states.pt``)
or one per rank (ZeRO-3: ``zero_pp_rank_D_mp_rank_NN_model_states.pt``). pyckpt reads from it the
parameter shapes by ZeRO group, the frozen parameters' shapes, the low-precision ``module``
tensors (the fallback source of parameters without optimizer state), the tensor-parallel merge
rules in ``universal_checkpoint_info``, the parallel degrees, the AutoEP layer list and the
config flags that change the expert layout. Everything here is checked once, when the file is
read, with errors naming the file and the key.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ..errors import quoted
from ..formats.pickle_read import TensorRef
from ..formats.torch_zip import SourceFile
from .names import check_param_name
from .schema import Schema

Shape = Tuple[int, ...]


@dataclass
class ModelStates:
    file: SourceFile
    # param_shapes: one {name: shape} per ZeRO param group (ZeRO-1/2) or sub-group (ZeRO-3)
    groups: List["OrderedDict[str, Shape]"]
    frozen: "OrderedDict[str, Shape]"
    # the module's tensors by name (non-tensor entries left out)
    module: "OrderedDict[str, TensorRef]"
    universal_info: Optional[dict]
    ds_config: dict
    # (pp_degree, tp_degree) when checkpoint_parallel_dimensions is recorded
    parallel_dims: Optional[Tuple[int, int]]
    # ds_autoep_layers (or the legacy autoep_layers) as written; validated by the AutoEP rules
    autoep_layers: Any
    # the module's persistent buffers, by name (a consolidated export keeps exactly these)
    buffer_names: Tuple[str, ...] = ()
    # tied parameters: alias -> the parameter whose storage it shares
    shared_params: "OrderedDict[str, str]" = field(default_factory=OrderedDict)
    # frozen parameters' tensors: whole under ZeRO-2, this rank's padded partition under ZeRO-3
    frozen_fragments: "OrderedDict[str, TensorRef]" = field(default_factory=OrderedDict)
    ds_version: Any = None
    global_steps: Any = None
    # the data- and model-parallel world sizes the engine saved at, as written (checked by their users)
    dp_world_size: Any = None
    mp_world_size: Any = None
    _shapes: Optional["OrderedDict[str, Shape]"] = field(default=None, repr=False)

    @property
    def path(self) -> str:
        return self.file.path

    @property
    def shapes(self) -> "OrderedDict[str, Shape]":
        """Every trainable parameter's shape, groups in order (names are unique across groups)."""
        if self._shapes is None:
            out = OrderedDict()
            for group in self.groups:
                out.update(group)
            self._shapes = out
        return self._shapes

    def raw(self) -> dict:
        """The dict as written: only for writing it back with keys added (AutoEP's re-save)."""
        return self.file.load()


def read_model_states(sf: SourceFile) -> ModelStates:
    obj = sf.load()
    s = Schema(sf.path)
    s.dict(obj, "the top-level object")
    groups: List[OrderedDict] = []
    seen: Dict[str, int] = {}
    for g, shapes in enumerate(s.list(obj.get("param_shapes"), "param_shapes", optional=True) or []):
        group = s.shapes(shapes, f"param_shapes[{g}]")
        for name in group:
            if name in seen:
                # its universal file would be written twice, the second replacing the first
                s.fail(f"param_shapes[{g}]",
                       f"lists {quoted(name)} more than once (also in param_shapes[{seen[name]}])")
            seen[name] = g
        groups.append(group)
    frozen = s.dict(obj.get("frozen_param_shapes"), "frozen_param_shapes", optional=True)
    module = s.dict(obj.get("module"), "module", optional=True) or {}
    s.names(module, "module")
    info = {key: s.dict(obj.get(key), key, optional=True)
            for key in ("universal_checkpoint_info", "ds_config", "checkpoint_parallel_dimensions")}
    layers = obj.get("ds_autoep_layers")
    if layers is None:
        layers = obj.get("autoep_layers")
    buffers = s.list(obj.get("buffer_names"), "buffer_names", optional=True) or ()
    for i, name in enumerate(buffers):
        check_param_name(name, sf.path, f"buffer_names[{i}]")
    shared = s.dict(obj.get("shared_params"), "shared_params", optional=True) or {}
    for alias, holder in shared.items():
        check_param_name(alias, sf.path, "shared_params key")
        check_param_name(holder, sf.path, f"shared_params[{quoted(alias)}]")
    fragments = s.dict(obj.get("frozen_param_fragments"), "frozen_param_fragments", optional=True) or {}
    for name, t in fragments.items():
        check_param_name(name, sf.path, "frozen_param_fragments key")
        s.tensor(t, f"frozen_param_fragments[{quoted(name)}]")
    return ModelStates(
        file=sf,
        groups=groups,
        frozen=s.shapes(frozen, "frozen_param_shapes") if frozen else OrderedDict(),
        module=OrderedDict((k, v) for k, v in module.items() if isinstance(v, TensorRef)),
        universal_info=info["universal_checkpoint_info"],
        ds_config=info["ds_config"] or {},
        parallel_dims=_parallel_dims(s, info["checkpoint_parallel_dimensions"]),
        autoep_layers=layers,
        buffer_names=tuple(buffers),
        shared_params=OrderedDict(shared),
        frozen_fragments=OrderedDict(fragments),
        ds_version=obj.get("ds_version"),
        global_steps=obj.get("global_steps"),
        dp_world_size=obj.get("dp_world_size"),
        mp_world_size=obj.get("mp_world_size"),
    )


def _parallel_dims(s: Schema, dims) -> Optional[Tuple[int, int]]:
    if dims is None:
        return None
    pp, tp = dims.get("pp_degree"), dims.get("tp_degree")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (pp, tp)):
        s.fail("checkpoint_parallel_dimensions", f"must hold positive pp_degree/tp_degree, got {dims}")
    return pp, tp


@dataclass
class ExpertWeights:
    """A per-expert ``layer_L_expert_E_mp_rank_NN_model_states.pt``: that expert's weights by name."""

    file: SourceFile
    tensors: "OrderedDict[str, TensorRef]"
    # AutoEP+AutoTP folded expert shards carry a 'folding' record
    folded: bool

    @property
    def path(self) -> str:
        return self.file.path


def read_expert_weights(sf: SourceFile) -> ExpertWeights:
    obj = sf.load()
    s = Schema(sf.path)
    s.dict(obj, "the top-level object")
    # keys are only looked up, never made into paths: no name check
    tensors = OrderedDict((name, value) for name, value in obj.items() if isinstance(value, TensorRef))
    return ExpertWeights(sf, tensors, "folding" in obj)
