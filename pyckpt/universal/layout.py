"""The Universal Checkpoint folder's layout rules, shared by its writer, its reader, its checker and
the load backend.

File names (the per-parameter state files ``zero/<name>/<state>.pt``, ``zero/optimizer_state.pt``, the
copied model states, ``latest_universal``) and what DeepSpeed 0.19.8's ``load_universal`` expects of
a ``zero/<name>/<state>.pt`` file. Kept apart from :mod:`~pyckpt.universal.read` so that
:mod:`pyckpt.universal.verify` gets the rules without the planners. Paths are relative to the
universal folder and '/'-separated, as the plan's file names are.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..tensors import numel
from ..errors import quoted
from ..formats.pickle_read import TensorRef
from ..zero.names import ZERO12_MODEL_RE, ZERO3_MODEL_RE  # noqa: F401  (the layout's model-state files)

# The folder of every parameter's states (one sub-folder per parameter) and of the optimizer's global state.
STATES_FOLDER = "zero"
OPTIMIZER_STATE_FILE = "optimizer_state.pt"
OPTIMIZER_STATE = f"{STATES_FOLDER}/{OPTIMIZER_STATE_FILE}"
STATE_SUFFIX = ".pt"
LATEST_UNIVERSAL = "latest_universal"
# The layout keys of a universal state dict that DeepSpeed's loader reads, and their types.
STATE_META_TYPES = {"cat_dim": int, "vocab_tensor": bool, "is_expert_param": bool, "ep_num_experts": int,
                    "param_n_sub_params": int}


def state_file(state: str) -> str:
    """The file of a parameter's ``state`` (``fp32``, ``exp_avg``, ...) in the parameter's folder."""
    return state + STATE_SUFFIX


def param_folder(name: str) -> str:
    """The folder of parameter ``name``'s states (a name legal as a folder name, checked by the caller)."""
    return f"{STATES_FOLDER}/{name}"


def param_state_path(name: str, state: str) -> str:
    return f"{param_folder(name)}/{state_file(state)}"


def param_of_path(relpath: str):
    """The parameter whose folder holds ``relpath`` (a path of a universal folder, '/'-separated), or
    None for a file outside the parameter folders."""
    parts = relpath.split("/")
    return parts[1] if len(parts) == 3 and parts[0] == STATES_FOLDER else None


def read_state(obj, stage) -> Tuple[Optional[TensorRef], dict, List[str]]:
    """A ``zero/<name>/<state>.pt`` object as DeepSpeed's ``load_universal`` reads it: (its tensor, its
    layout keys, the rules it breaks). The tensor is None when there is none to use."""
    tensor, meta = obj, {}
    if isinstance(obj, dict):
        tensor = obj.get("param")
        meta = {k: v for k, v in obj.items() if k != "param"}
    elif not (stage == 3 and isinstance(obj, TensorRef)):
        what = "tensor" if isinstance(obj, TensorRef) else type(obj).__name__
        return None, meta, [f"holds a {what}; load_universal expects a dict with a 'param' tensor"]
    if not isinstance(tensor, TensorRef):
        return None, meta, ["has no 'param' tensor, which load_universal reads"]
    problems = []
    if tensor.dtype != "float32":
        problems.append(f"holds {tensor.dtype}; DeepSpeed's universal states are float32")
    for key, typ in STATE_META_TYPES.items():
        if key in meta and (type(meta[key]) is not typ):
            problems.append(f"marker {quoted(key)} is {quoted(meta[key])}, expected a {typ.__name__}")
    cat_dim = meta.get("cat_dim")
    if type(cat_dim) is int and not 0 <= cat_dim < max(1, len(tensor.shape)):
        problems.append(f"cat_dim {cat_dim} is not a dimension of the {len(tensor.shape)}-d tensor")
    if meta.get("is_expert_param") is True and type(meta.get("ep_num_experts")) is not int:
        problems.append("expert parameter without an integer 'ep_num_experts', which load_universal needs to slice "
                        "experts at another expert-parallel size")
    return tensor, meta, problems


def fits(full: tuple, local: Dict[int, tuple], tp: int, meta: dict, raw: bool) -> bool:
    """Can ``full`` be the universal tensor of a parameter with these per-tp-rank shapes?

    The rules mirror what the loader undoes: replicated or averaged (equal shapes); AutoEP experts
    (dim 0 is ``ep_num_experts``, the other dims local); tensor-parallel slices concatenated along one
    dimension (row-/column-parallel, sub-parameters, uneven AutoTP widths), vocabulary rows possibly
    stripped to the original vocab size; ZeRO-3 dense parameters as one flat tensor."""
    shapes = list(local.values())
    if not shapes:
        return True
    if meta.get("is_expert_param") is True:
        n = meta.get("ep_num_experts", full[0] if full else None)
        return (len(full) >= 1 and full[0] == n and all(len(s) == len(full) and s[1:] == full[1:]
                                                         and (s[0] == 0 or n % s[0] == 0) for s in shapes))
    if raw:
        return len(full) == 1 and len(set(shapes)) == 1 and full[0] == numel(shapes[0])
    if all(s == full for s in shapes):
        return True
    # AutoTP ranks left without heads may record no shape at all: they add nothing to the sum.
    if len(shapes) > tp or any(len(s) != len(full) for s in shapes):
        return False
    for d in range(len(full)):
        if any(s[:d] + s[d + 1:] != full[:d] + full[d + 1:] for s in shapes):
            continue
        total = sum(s[d] for s in shapes)
        if total == full[d] or (d == 0 and meta.get("vocab_tensor") is True and full[d] <= total):
            return True
    return False
