"""Universal load for ZeRO-1/2 (``DeepSpeedZeroOptimizer``) and ``BF16_Optimizer``.

The state DeepSpeed 0.19.8's ``ZeROOptimizer.load_hp_checkpoint_state_from_checkpoint_dir`` leaves,
built from each rank's own bytes: the loss-scaler fields (``_load_global_state``), every mapped
fragment of the flat fp32 partition filled in place (padding untouched), one flat buffer per
optimizer state key shaped, typed and placed like the partition (zero at padding; the optimizer's
current one refilled where it fits, where DeepSpeed allocates a new one) with each
parameter's ``optim_fragment[key]`` a view of it, the group's ``step`` and its hyper-parameters.
Each parameter's slice of a state file follows DeepSpeed's order: its experts (AutoEP placement, or
the legacy contiguous rows), then its tensor-parallel cut (AutoTP metadata, or the generic rules).

A load of the memory tier (:func:`lp_from_files`), where every rank's files lie in its node's memory,
also fills the flat low-precision buffers, when they live in host memory, as DeepSpeed's
``update_lp_params`` leaves them after the engine's load: the rank's own partition copied (cast) from
its fp32 partition as DeepSpeed copies it, every other partition's parameters cast from the same
fp32 files instead of gathered from the other ranks (over gloo, an all-gather of the whole model
costs more than reading it from memory); the engine's ``update_lp_params`` call that follows the
load is then skipped once. Padding after the other ranks' partitions keeps its value (zero since the
engine was built; DeepSpeed's gather copies their fp32 padding there, zero as well: it is never
stepped). Any other load reads only the rank's own bytes and leaves the gather to DeepSpeed, as on
a device (a collective over the device links moves the model faster than host reads and copies up).

One difference, on purpose: a rank whose partition of a group is padding only gets that group's
step and zero state buffers (from the group's first parameter's folder), as a run that never
checkpointed has them; DeepSpeed dies there with ``IndexError``.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List

from ...universal.slice import narrow, tp_slice_runs, total
from ...errors import CheckpointFormatError
from . import restore_targets
from .gather import TensorFill, state_buffer
from .state_files import FolderStates
from .unsupported import Unsupported


def _step_equal(a, b) -> bool:
    import torch

    if torch.is_tensor(a) and torch.is_tensor(b):
        return bool(torch.equal(a, b))
    return a == b


def _runs(lp, sf, key: str, autotp, tp_rank: int, tp_size: int, ep_rank: int, ep_size: int):
    """The live parameter's flattened slice of state file ``sf``, as runs of its tensor: DeepSpeed's
    order (experts, then the tensor-parallel cut), with the parameter's AutoEP / AutoTP metadata
    checked by DeepSpeed's own resolvers first."""
    from ...universal.restore_meta import NotACopy, autotp_runs

    where = sf.source.path
    try:
        experts = None
        shape = tuple(sf.tensor.shape)
        if sf.meta.get("is_expert_param", False):
            experts = restore_targets.zero12_experts(lp, sf.meta, shape, ep_rank, where)
            if experts is not None:
                shape = experts[1]
        expected = restore_targets.autotp_numel(lp, sf.meta, shape, tp_rank, tp_size, key) if autotp else None
        cut = (lambda shape, base: autotp_runs(autotp, shape, base, tp_rank, tp_size, key)) if autotp else None
        runs = tp_slice_runs(sf.tensor.shape, sf.meta, tuple(lp.shape), tp_rank, tp_size, ep_rank, ep_size, where,
                             experts=experts, autotp=cut)
    except NotACopy as exc:
        raise Unsupported(f"{where}: {exc}") from None
    if expected is not None and total(runs) != expected:
        raise Unsupported(f"{where}: DeepSpeed cuts {expected} elements, pyckpt's runs {total(runs)}")
    return runs


def plan(opt, lp_groups_name: str, states=None, checkpoint_dir: str = ""):
    """Everything the load will do, with nothing changed yet: returns ``apply()``, which does it and
    returns the bytes it gathered. ``states`` reads the universal files (default: the ``zero/`` folder
    of ``checkpoint_dir``)."""
    from deepspeed.checkpoint.universal_checkpoint import _get_param_uc_restore_meta
    from deepspeed.runtime.base_optimizer import _get_universal_checkpoint_ep_info
    from deepspeed.runtime.utils import bwc_tensor_model_parallel_rank

    states = states or FolderStates(checkpoint_dir)
    gs = states.global_state(2)
    tp_rank = bwc_tensor_model_parallel_rank(mpu=opt.mpu)
    if opt.mpu is None:
        tp_size = 1
    elif hasattr(opt.mpu, "get_slice_parallel_world_size"):
        tp_size = opt.mpu.get_slice_parallel_world_size()
    else:
        tp_size = opt.mpu.get_tensor_model_parallel_world_size()
    ep_rank, ep_size = _get_universal_checkpoint_ep_info()
    lp_groups = getattr(opt, lp_groups_name)
    lp_flat = _host_lp_flat(opt, lp_groups_name) if _LP_FROM_FILES else None

    groups = []
    for i, (group, ckpt_group) in enumerate(zip(opt.optimizer.param_groups, gs.param_groups)):
        flat = group["params"][0]
        # state key -> [(state file, its runs, where they land in the flat)]; the buffers are made
        # only when the plan is applied, so nothing exists before every rank has planned.
        buffers: Dict[str, List[tuple]] = {}
        fp32 = TensorFill(flat)
        links: List[tuple] = []  # (lp, hp_start, numel)
        steps = []
        keys_of = []  # (parameter's states, its state keys): every mapped parameter must have the group's keys
        lp_fill = _LowPrecisionFill(opt, lp_flat, i) if lp_flat else None
        for lp in lp_groups[i]:
            mapping = lp._hp_mapping
            if mapping is None:
                if lp_fill is not None:
                    ps = states.param_states(opt.param_names[lp], 2)
                    sf = ps.states.get("fp32")
                    if sf is None:
                        raise _missing_master(ps)
                    lp_fill.add(lp, sf, _runs(lp, sf, "fp32", _get_param_uc_restore_meta(lp), tp_rank, tp_size,
                                              ep_rank, ep_size))
                continue
            autotp = _get_param_uc_restore_meta(lp)
            ps = states.param_states(opt.param_names[lp], 2)
            lp_start, numel = mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
            hp_start = mapping.hp_fragment_address.start
            for key, sf in ps.states.items():
                if not sf.is_dict:
                    raise Unsupported(f"{sf.source.path} holds a bare tensor")
                runs = _runs(lp, sf, key, autotp, tp_rank, tp_size, ep_rank, ep_size)
                part = narrow(runs, lp_start, numel)
                if total(part) != numel:
                    raise RuntimeError(f"start ({lp_start}) + length ({numel}) exceeds dimension size "
                                       f"({total(runs)})")
                if key == "fp32":
                    fp32.add(sf.source, sf.tensor, part, hp_start)
                    if lp_fill is not None:
                        lp_fill.add(lp, sf, runs)
                else:
                    buffers.setdefault(key, []).append((sf, part, hp_start))
            links.append((lp, hp_start, numel))
            steps.append(ps.step)
            keys_of.append((ps, set(ps.states) | ({"step"} if ps.step is not None else set())))
        _check_complete(keys_of, i)
        if not links and lp_groups[i]:
            # Padding only on this rank: the group's step and state keys from its first parameter.
            ps = states.param_states(opt.param_names[lp_groups[i][0]], 2)
            steps.append(ps.step)
            for key in ps.states:
                if key != "fp32":
                    buffers.setdefault(key, [])
        assert all(_step_equal(s, steps[0]) for s in steps), f"Steps {steps} are not equal"
        groups.append((group, ckpt_group, flat, fp32, buffers, links, steps[0] if steps else None, lp_fill))

    def apply(workers: int = 0) -> int:
        opt._load_global_state(_global_view(gs, opt))
        nbytes = 0
        for group, ckpt_group, flat, fp32, buffers, links, step, lp_fill in groups:
            for lp, _, _ in links:
                lp._hp_mapping.optim_fragment = {}
            fp32.run(workers)
            nbytes += fp32.bytes_read
            if lp_fill is not None:
                nbytes += lp_fill.run(workers)
            if step is not None:
                opt.optimizer.state[flat]["step"] = step
            for key in sorted(buffers):
                # DeepSpeed's buffer is zero outside the fragments (map_to_flat_opt_states); the gather
                # writes the fragments and zeroes only the rest, instead of zeroing it all first
                buffer = state_buffer(opt.optimizer.state[flat], key, flat)
                fill = TensorFill(buffer)
                covered = []
                for sf, part, hp_start in buffers[key]:
                    covered.append((hp_start, hp_start + fill.add(sf.source, sf.tensor, part, hp_start)))
                for lo, hi in _gaps(covered, buffer.numel()):
                    fill.add(None, None, [(None, hi - lo)], lo)
                fill.run(workers)
                nbytes += fill.bytes_read
                for lp, hp_start, numel in links:
                    lp._hp_mapping.optim_fragment[key] = buffer.narrow(0, hp_start, numel)
                opt.optimizer.state[flat][key] = buffer
            for key, value in ckpt_group.items():
                if key != "params":
                    group[key] = value
        if lp_flat:
            skip_lp_update(opt)
        return nbytes

    return apply


_LP_FROM_FILES = False


@contextlib.contextmanager
def lp_from_files():
    """Loads planned inside fill the flat low-precision buffers from the fp32 files (module docstring)."""
    global _LP_FROM_FILES
    before, _LP_FROM_FILES = _LP_FROM_FILES, True
    try:
        yield
    finally:
        _LP_FROM_FILES = before


# lp groups attribute -> (its flat buffers, their per-rank partitions, the rank's fp32 partitions), for
# DeepSpeedZeroOptimizer and BF16_Optimizer, as their update_lp_params reads them.
_LP_LAYOUT = {"bit16_groups": ("bit16_groups_flat", "parallel_partitioned_bit16_groups",
                               "single_partition_of_fp32_groups"),
              "bf16_groups": ("bf16_groups_flat", "bf16_partitioned_groups", "fp32_groups_flat_partition")}


def _host_lp_flat(opt, lp_groups_name: str):
    """The optimizer's flat low-precision buffers and partitions when they all live in host memory
    (the load fills them there), else None (DeepSpeed's update_lp_params gathers them)."""
    names = _LP_LAYOUT.get(lp_groups_name)
    if names is None or not all(hasattr(opt, n) for n in names) or not hasattr(opt, "real_dp_process_group"):
        return None
    flats, parts, fp32 = (getattr(opt, n) for n in names)
    if not all(f.device.type == "cpu" and f.dim() == 1 and f.is_contiguous() for f in flats):
        return None
    return flats, parts, fp32


class _LowPrecisionFill:
    """Group ``i``'s flat low-precision buffer as ``update_lp_params`` leaves it: the rank's own partition
    from its fp32 partition, every parameter's elements outside it cast from its fp32 state file."""

    def __init__(self, opt, lp_flat, i: int):
        from deepspeed import comm as dist

        flats, parts, fp32 = lp_flat
        self.flat, self.fp32 = flats[i], fp32[i]
        self.own = parts[i][dist.get_rank(group=opt.real_dp_process_group[i])]
        start = (self.own.data_ptr() - self.flat.data_ptr()) // self.flat.element_size()
        if not 0 <= start <= self.flat.numel() - self.own.numel():
            raise Unsupported("the rank's low-precision partition is not a view of its flat buffer")
        self.own_range = (start, start + self.own.numel())
        self.fill = TensorFill(self.flat)

    def add(self, lp, sf, runs) -> None:
        """Parameter ``lp``'s elements outside the rank's own partition, from the runs of its fp32 file."""
        at, misaligned = divmod(lp.data_ptr() - self.flat.data_ptr(), self.flat.element_size())
        n = lp.numel()
        if misaligned or at < 0 or at + n > self.flat.numel() or not lp.is_contiguous():
            raise Unsupported(f"parameter {tuple(lp.shape)} is not a view of its group's flat low-precision buffer")
        if total(runs) != n:
            raise CheckpointFormatError(f"{sf.source.path}: {total(runs)} elements for a parameter of {n}")
        lo, hi = self.own_range
        for a, b in ((at, min(at + n, lo)), (max(at, hi), at + n)):
            if a < b:
                self.fill.add(sf.source, sf.tensor, narrow(runs, a - at, b - a), a)

    def run(self, workers: int) -> int:
        """DeepSpeed's copy of the rank's partition, then the gather of the rest; the bytes read."""
        import torch

        with torch.no_grad():
            self.own.copy_(self.fp32)
        self.fill.run(workers)
        return self.fill.bytes_read


def skip_lp_update(opt) -> None:
    """The engine's next ``update_lp_params`` call, the one right after the optimizer's load, does
    nothing: the load filled the flat low-precision buffers as it would."""
    # once: the load that filled the flat buffers is the one whose update this is
    opt.update_lp_params = lambda: end_of_load(opt)


def end_of_load(opt) -> None:
    """After ``load_checkpoint``, also one that failed between the optimizer's load and the engine's
    ``update_lp_params``: the optimizer's own method again."""
    if opt is not None:
        getattr(opt, "__dict__", {}).pop("update_lp_params", None)


def _check_complete(keys_of, group: int) -> None:
    """Every parameter mapped to this rank has its fp32 master and every state key another parameter
    of its group has: a missing file would leave that parameter's fragment of the flat buffer zero
    (or its master as the fresh model made it). DeepSpeed's map_to_flat_opt_states raises on a missing
    moment with the message kept here; it keeps the master without fp32.pt, which is wrong."""
    keys = set().union(*(k for _, k in keys_of)) if keys_of else set()
    for ps, have in keys_of:
        if "fp32" not in have:
            raise _missing_master(ps)
        if "step" in keys - have:
            raise CheckpointFormatError(f"{ps.path_of('step')}: missing: the other parameters of param group {group} "
                                        "have their step")
        for key in sorted(keys - have):
            raise ValueError(f"{key} not found in optimizer state fragment: {ps.path_of(key)} is missing (other "
                             f"parameters of param group {group} have one)")


def _missing_master(ps) -> CheckpointFormatError:
    return CheckpointFormatError(f"{ps.path_of('fp32')}: missing: the parameter's fp32 master (every parameter "
                                 "of a Universal Checkpoint has one)")


def _gaps(covered, n: int):
    """The ranges of [0, n) that no (start, stop) of ``covered`` reaches."""
    at = 0
    for lo, hi in sorted(covered):
        if lo > at:
            yield at, lo
        at = max(at, hi)
    if at < n:
        yield at, n


def _global_view(gs, opt) -> dict:
    """``optimizer_state.pt`` as ``_load_global_state`` reads it, with the loss scaler rebuilt safely."""
    from .state_files import loss_scaler

    view = {k: v for k, v in gs.raw.items() if k != "loss_scaler"}
    if "loss_scaler" in gs.raw:
        view["loss_scaler"] = loss_scaler(gs.raw["loss_scaler"], getattr(opt, "loss_scaler", None), gs.path)
    return view
