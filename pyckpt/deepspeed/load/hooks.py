"""Where pyckpt takes over DeepSpeed's Universal Checkpoint load, and the agreement around it.

DeepSpeed reaches a universal load only through ``engine._load_zero_checkpoint``, which calls the
optimizer's ``_load_universal_checkpoint(checkpoint_folder, load_optimizer_states,
load_from_fp32_weights)``; replacing that method on the three optimizer classes leaves the rest of
``load_checkpoint`` DeepSpeed's own (``latest_universal``, the model-state file, scheduler, counters,
``client_state``, the ZeRO-3 prologue and epilogue, ``update_lp_params``).

Every rank plans its load first, changing nothing; the ranks then agree with one collective (every
rank is inside ``load_checkpoint``, a collective call, so all of them reach it). If any rank's plan
failed, all raise, each naming the failing ranks, and none has changed its state; no rank is left
waiting in DeepSpeed's later collectives. If any rank met a layout this backend does not load yet,
all ranks hand the call to DeepSpeed's own method, with a warning, once every rank has found each
file that method may unpickle parsable by pyckpt's allowlist reader (:mod:`.pickle_policy`; skipped
for a checkpoint the user trusts).

The replacements themselves are declared, version-guarded and installed by
``pyckpt.deepspeed.integrations.deepspeed_engine``; this module is what they run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Callable, Dict, Optional, Tuple

from ...errors import (CheckpointFormatError, RankLoadError, UnsafePickleError, UnsupportedCheckpointError, printable,
                       printable_line)
from ...execution.distributed import TorchRanks, agreed
from ..settings import SETTINGS
from ..tiers import prechecked
from . import model_state_file
from . import pickle_policy
from . import resume
from . import stage3_restore as zero3
from . import stage12_restore as zero12
from . import zero_view
from .unsupported import Unsupported

logger = logging.getLogger("pyckpt")

# (module, class) -> the planner of that optimizer class's universal load
PLANNERS: Dict[Tuple[str, str], Callable] = {
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"):
        lambda opt, folder, los, lfp32, states: zero12.plan(opt, "bit16_groups", states, folder),
    ("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer"):
        lambda opt, folder, los, lfp32, states: zero12.plan(opt, "bf16_groups", states, folder),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"):
        lambda opt, folder, los, lfp32, states: zero3.plan(opt, folder, los, lfp32, states),
}
# What the last load through pyckpt did on this rank, for tests and benchmarks.
last_load: Dict[str, object] = {}


def trust_pickles(value: Optional[bool] = None) -> bool:
    """The current setting; with ``value``, set it and return the previous one."""
    return _setting("trust_pickles", value)


def reshard(value: Optional[bool] = None) -> bool:
    """Whether a plain load of a ZeRO checkpoint saved at another topology reshards (the current
    setting; with ``value``, set it and return the previous one)."""
    return _setting("reshard", value)


def _setting(key: str, value: Optional[bool]) -> bool:
    previous = getattr(SETTINGS, key)
    if value is not None:
        setattr(SETTINGS, key, bool(value))
    return previous


def memory_tier(value=False):
    """The memory tier a resume looks in (a :class:`~pyckpt.deepspeed.tiers.policy.MemoryTier`, or
    None); with ``value`` (a tier or None), set it and return the previous one."""
    previous = SETTINGS.resume_tier
    if value is not False:
        SETTINGS.resume_tier = value
        if value is not None:  # a restarted job checks its newest memory files while it builds its engine
            prechecked.start(value)
    return previous


def _newest_tier(engine, load_dir, tag):
    """(load_dir, tag, from_memory) of the newest checkpoint across every node's memory tier and
    ``load_dir`` (durable), agreed by every rank before any state changes (:mod:`.memory_recovery`);
    unchanged (and False) where no tier is set, a tag was named, or the durable one is the newest."""
    from . import memory_recovery

    tier = SETTINGS.resume_tier
    if tier is None or tag is not None:
        return load_dir, tag, False
    found = memory_recovery.recover(tier, os.fspath(load_dir), job_ranks())
    return (*found, True) if found is not None else (load_dir, tag, False)


def job_ranks() -> Optional[TorchRanks]:
    """The job's ranks to agree with, or None alone (no process group, or a group of one)."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return None
    return TorchRanks()


def agreed_step(what: str, step: Callable):
    """``step()`` on every rank, then one agreement: a failure on any rank raises on every rank before
    any of them goes on (where a rank raised alone, the others would wait in the next collective
    until the process group's timeout). Every rank must call it, in the same order."""
    with agreed(job_ranks(), what, error=RankLoadError, own=True) as vote:
        vote.value = step()
    return vote.value


def universal_load_of(planner: Callable, original: Callable):
    def _load_universal_checkpoint(self, checkpoint_folder, load_optimizer_states, load_from_fp32_weights):
        t0 = time.perf_counter()
        apply = None
        direct = zero_view.registered(checkpoint_folder)
        ranks = job_ranks()
        with agreed(ranks, "the universal load", error=RankLoadError, own=True) as vote:
            try:
                # a ZeRO checkpoint read as its universal view (zero_view), or the universal folder
                apply = planner(self, checkpoint_folder, load_optimizer_states, load_from_fp32_weights,
                                zero_view.lookup(checkpoint_folder))
            except Unsupported as exc:
                if direct:  # there is no universal folder for DeepSpeed's loader to fall back on
                    raise UnsupportedCheckpointError(
                        f"{checkpoint_folder}: {exc}; resuming straight from the ZeRO checkpoint does not serve "
                        "this yet: convert it with `python -m pyckpt.convert` and load the universal folder") from None
                vote.value = str(exc)  # this rank's reason to hand the load back to DeepSpeed
        unsupported_all = [(rank, reason) for rank, reason in enumerate(vote.values) if reason]
        if unsupported_all:
            rank, reason = unsupported_all[0]
            if not SETTINGS.trust_pickles:
                # DeepSpeed unpickles with torch.load(weights_only=False): every rank checks the files
                # first, and all stop together if any was refused, before DeepSpeed reads one
                with agreed(ranks, "checking the universal folder's pickles", error=RankLoadError,
                            own=True) as check:
                    check.value = pickle_policy.check_universal_pickles(checkpoint_folder)
                refusals = [(r, message) for r, message in enumerate(check.values) if message]
                if refusals:
                    where, message = refusals[0]
                    raise UnsafePickleError(f"pyckpt: DeepSpeed's own loader would take this universal load "
                                            f"(rank {rank}: {reason}), but rank {where} refused a file: {message}")
            logger.warning("pyckpt: DeepSpeed's own loader takes this universal load (rank %d: %s)", rank,
                           printable_line(reason))
            last_load.clear()
            last_load.update(backend="deepspeed", reason=reason)
            return original(self, checkpoint_folder, load_optimizer_states, load_from_fp32_weights)
        t1 = time.perf_counter()
        nbytes = apply()
        t2 = time.perf_counter()
        last_load.clear()
        # started/gathered: perf_counter stamps of the planning start and the gather's end
        # lp_filled: the flat low-precision buffers were filled by the load, not gathered by DeepSpeed after it
        last_load.update(backend="pyckpt", bytes_read=nbytes, plan_s=t1 - t0, gather_s=t2 - t1, started=t0,
                         gathered=t2, direct=direct, lp_filled="update_lp_params" in vars(self))

    _load_universal_checkpoint.__wrapped__ = original
    _load_universal_checkpoint.__pyckpt__ = True
    return _load_universal_checkpoint


def mapped_load(original: Callable) -> Callable:
    """``original`` (DeepSpeed's ``load_checkpoint``) with the model-state file mapped once."""

    def call(self, load_dir, tag=None, *args, **kwargs):
        if not model_state_file.applies_to(self.checkpoint_engine):
            # another engine reads the model-state files its own way: every file is checked first
            return _deepspeed_load(original, self, load_dir, tag, *args, **kwargs)
        last_load.clear()
        inner = self.checkpoint_engine
        wrapper = model_state_file.MappedModelStates(inner, SETTINGS.trust_pickles)
        # DeepSpeed reads these files before the optimizer load, the first step pyckpt agrees on: a
        # file that fails on one rank only would leave the others waiting there.
        tag = agreed_step("reading the model-state file",
                          lambda: model_state_file.read_ahead(self, wrapper, load_dir, tag))
        # The model-state files go through the weights-only reader above; any other torch file of the
        # tag folder (the ZeRO shards a ZeRO-3 load without optimizer states reads) is parsed first
        _check_pickles(self, load_dir, tag, skip=model_state_file.MODEL_STATES_SUFFIX)
        self.checkpoint_engine = wrapper
        saved = _counters(self)
        try:
            return original(self, load_dir, tag, *args, **kwargs)
        except BaseException:
            # DeepSpeed sets these from the model-state file before the optimizer load; a load that
            # fails there (pyckpt's refusals included) leaves them as they were before the call
            _restore_counters(self, saved)
            raise
        finally:
            self.checkpoint_engine = inner
            last_load["model_states_mapped"] = list(wrapper.mapped)
            last_load["model_states_refused"] = list(wrapper.refused)

    return call


# What DeepSpeed's _load_checkpoint assigns on the engine before the optimizer load begins.
_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "loaded_checkpoint_dp_world_size",
             "loaded_checkpoint_mp_world_size", "_curr_ckpt_path")
_SCHEDULERS = ("lr_scheduler", "random_ltd_scheduler")


def _counters(engine) -> tuple:
    import copy

    fields = {k: getattr(engine, k) for k in _COUNTERS if hasattr(engine, k)}
    missing = [k for k in _COUNTERS if not hasattr(engine, k)]
    schedulers = {k: copy.deepcopy(getattr(engine, k).state_dict()) for k in _SCHEDULERS
                  if hasattr(getattr(engine, k, None), "state_dict")}
    return fields, missing, schedulers


def _restore_counters(engine, saved: tuple) -> None:
    fields, missing, schedulers = saved
    for k, v in fields.items():
        setattr(engine, k, v)
    for k in missing:
        engine.__dict__.pop(k, None)
    for k, state in schedulers.items():
        getattr(engine, k).load_state_dict(state)


def engine_load(original: Callable):
    """``DeepSpeedEngine.load_checkpoint`` under ``enable()``: a universal load maps the model-state
    file once, and one that names a plain ZeRO checkpoint resumes from it directly (:mod:`.resume`);
    so does a plain load of a ZeRO checkpoint saved at another topology, which DeepSpeed's own load
    refuses (``enable(reshard=False)`` leaves that to DeepSpeed)."""
    mapped = mapped_load(original)

    def load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
        try:
            return dispatch(self, load_dir, tag, *args, **kwargs)
        finally:  # a load that filled the low-precision buffers and failed before the engine's update
            zero12.end_of_load(getattr(self, "optimizer", None))

    def dispatch(self, load_dir, tag=None, *args, **kwargs):
        agree_arguments(tag, args, kwargs)
        load_dir, tag, from_memory = _newest_tier(self, load_dir, tag)
        if not self.load_universal_checkpoint():
            if not SETTINGS.reshard or kwargs.get("load_module_only"):
                return _deepspeed_load(original, self, load_dir, tag, *args, **kwargs)
            found = agreed_step("comparing the checkpoint's topology with the engine's",
                                lambda: resume.reshard_target(self, load_dir, tag, SETTINGS.trust_pickles))
            if found is None and from_memory:
                return _memory_load(self, load_dir, tag, mapped, original, args, kwargs)
            if found is None:  # the topology it was saved at: DeepSpeed's own load
                return _deepspeed_load(original, self, load_dir, tag, *args, **kwargs)
            folder, tag_found, was, now = found
            ranks = job_ranks()
            if ranks is None or ranks.rank == 0:
                logger.warning("pyckpt: resharding %s from %s to %s, straight from the ZeRO shards "
                               "(pyckpt.deepspeed.enable(reshard=False) leaves such loads to DeepSpeed)",
                               printable(os.path.join(folder, tag_found)), was, now)
            # a memory checkpoint's files are all in this node's memory (the recovery put them there)
            with zero12.lp_from_files() if from_memory else contextlib.nullcontext():
                return resume.load_zero(self, folder, tag_found, mapped, *args, **kwargs)
        target = agreed_step("finding the checkpoint", lambda: resume.resumable_target(self, load_dir, tag))
        if target is not None:
            return resume.load_zero(self, *target, mapped, *args, **kwargs)
        return mapped(self, load_dir, tag, *args, **kwargs)

    load_checkpoint.__wrapped__ = original
    load_checkpoint.__pyckpt__ = True
    return load_checkpoint


def _memory_load(engine, load_dir, tag, mapped: Callable, original: Callable, args: tuple, kwargs: dict):
    """A memory checkpoint at the topology it was saved at, read by the direct resume: each rank copies
    its own byte ranges of the mapped tmpfs shards into its flat fp32 partition and moments (nothing
    of the optimizer shards is unpickled but their small pickles, and nothing is copied twice), where
    DeepSpeed's own load unpickles every shard whole and copies it in. A layout the direct resume does
    not know is planned as such on every rank before any state changes: the load is then DeepSpeed's
    own, said in one line."""
    target = agreed_step("finding the memory checkpoint", lambda: _memory_target(engine, load_dir, tag))
    ranks = job_ranks()
    if isinstance(target, str):
        why = target
    else:
        out, failure = None, None
        try:
            with zero12.lp_from_files():  # every rank's files are in its node's memory
                out = resume.load_zero(engine, *target, mapped, *args, **kwargs)
        except Exception as exc:
            failure = exc
        # The direct plan is agreed before any optimizer state changes: a rank that met a layout it does not
        # know raises UnsupportedCheckpointError, the others RankLoadError naming it, and the model-state
        # counters and schedulers were put back by the mapped load. Every rank learns what each met, so all
        # fall back together, or all raise (any other failure), never one alone.
        kind = ("ok" if failure is None else "unsupported" if isinstance(failure, UnsupportedCheckpointError)
                else "echo" if isinstance(failure, RankLoadError) else "other")
        kinds = [kind] if ranks is None else ranks.all_gather(kind)
        if "other" in kinds or ("unsupported" not in kinds and failure is not None):
            if failure is None:
                raise RankLoadError("the direct load of the memory checkpoint",
                                    {r: "failed" for r, k in enumerate(kinds) if k != "ok"}, len(kinds))
            raise failure
        if "unsupported" not in kinds:
            return out
        why = str(failure) if kind == "unsupported" else "another rank met a layout the direct load does not know"
    if ranks is None or ranks.rank == 0:
        logger.warning("pyckpt: DeepSpeed's own load reads the memory checkpoint %s (%s)",
                       printable(os.path.join(os.fspath(load_dir), str(tag))), printable_line(why))
    return _deepspeed_load(original, engine, load_dir, tag, *args, **kwargs)


def _memory_target(engine, load_dir, tag):
    """(load_dir, tag) for the direct resume, or why it cannot take this checkpoint (a line)."""
    try:
        target = resume.resumable_target(engine, load_dir, tag)
    except UnsupportedCheckpointError as exc:
        return str(exc)
    return target if target is not None else f"{printable(load_dir)} names no ZeRO checkpoint"


def _deepspeed_load(original: Callable, engine, load_dir, tag, *args, **kwargs):
    """DeepSpeed's own plain load, which unpickles the tag folder's files with
    ``torch.load(weights_only=False)``: under ``enable()`` every rank first parses its share of them with
    pyckpt's reader and the ranks agree, so a file that would run code stops every rank with
    UnsafePickleError before DeepSpeed reads one (``enable(trust_pickles=True)`` skips the check)."""
    _check_pickles(engine, load_dir, tag)
    return original(engine, load_dir, tag, *args, **kwargs)


def _check_pickles(engine, load_dir, tag, skip: str = "") -> None:
    """Every rank parses its share of the tag folder's torch files (those not ending in ``skip``) with
    pyckpt's reader, and the ranks agree: a refusal anywhere raises on every rank (UnsafePickleError
    for a global off the allowlist, CheckpointFormatError for a file pyckpt cannot parse), before
    DeepSpeed unpickles any of them. Nothing is checked for a checkpoint the user trusts. Under ZeRO-3
    the folder ``latest`` names is checked too: DeepSpeed's load without optimizer states rebuilds the
    weights from it (``get_fp32_state_dict_from_zero_checkpoint(load_dir)``), whatever the tag."""
    if SETTINGS.trust_pickles:
        return
    ranks = job_ranks()
    rank, size = (0, 1) if ranks is None else (ranks.rank, ranks.size)
    pointer = "latest_universal" if engine.load_universal_checkpoint() else "latest"

    def check():
        folders = [pickle_policy.deepspeed_tag_folder(load_dir, tag, pointer)]
        if engine.zero_optimization_partition_weights():
            folders.append(pickle_policy.deepspeed_tag_folder(load_dir, None, "latest"))
        for folder in dict.fromkeys(f for f in folders if f is not None):
            found = pickle_policy.check_tag_pickles(folder, rank, size, skip)
            if found:
                return found
        return None

    with agreed(ranks, "checking the checkpoint's pickles", error=RankLoadError, own=True) as vote:
        vote.value = check()
    refusals = [(r, found) for r, found in enumerate(vote.values) if found]
    if refusals:
        where, (kind, message) = refusals[0]
        error = UnsafePickleError if kind == "UnsafePickleError" else CheckpointFormatError
        raise error(f"pyckpt: DeepSpeed's own load would unpickle this checkpoint, but rank {where} refused a file: "
                    f"{message}")


def agree_arguments(tag, args: tuple, kwargs: dict) -> None:
    """A load is collective: ranks that pass a different tag or different options (optimizer states on
    some ranks only, a module-only load on some) would read different things, or part ways in
    DeepSpeed's collectives. One all-gather compares them first; a difference raises RankLoadError on
    every rank, naming the values, before anything is read. The folder is not compared: nodes may
    mount the same checkpoint at different paths."""
    def plain(value):
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        return f"<{getattr(value, '__qualname__', type(value).__qualname__)}>"  # a function: its name, not its address

    shape = (None if tag is None else str(tag), tuple(plain(a) for a in args),
             tuple(sorted((k, plain(v)) for k, v in kwargs.items())))
    with agreed(job_ranks(), "comparing the load's tag and options", same=True, error=RankLoadError) as vote:
        vote.value = shape
