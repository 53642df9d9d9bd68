"""Writing a synthetic checkpoint: the model sized from a parameter count or a family, checked
against the topology, planned and executed in batches."""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from pathlib import Path
from typing import List, Optional

from ..execution.executor import execute
from ..planning.plan import Plan
from .models import FAMILY_EXPERTS, Model, size_model
from .noise import Noise
from . import records
from .zero_writer import Topology, ZeroWriter


def parse_count(text) -> int:
    """'1B', '350M', '50k', '2e9' or an int."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}.get(s[-1:], 1)
    return int(float(s[:-1] if scale != 1 else s) * scale)


def _recovery_scripts() -> List[str]:
    # DeepSpeed copies these next to `latest`; find them without importing deepspeed.
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return []
    base = os.path.join(list(spec.submodule_search_locations)[0], "utils")
    return [p for p in (os.path.join(base, s) for s in ("zero_to_fp32.py", "zero_to_torch.py")) if os.path.isfile(p)]


def check_topology(model: Model, *, dp: int, stage: int, dtype: str, ep: int, sub_group_size: Optional[int]) -> None:
    if stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1, 2 or 3, not {stage}")
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be fp32 or bf16, not {dtype!r}")
    if dp < 1 or ep < 1 or dp % ep:
        raise ValueError(f"--ep {ep} must divide --dp {dp}")
    if model.autoep and any(layer.ep_size != ep for layer in model.layers):
        raise ValueError("every AutoEP layer must use the run's ep size")
    if sub_group_size is not None and (stage != 3 or sub_group_size < 1):
        raise ValueError("--sub-group-size is a ZeRO-3 setting (a positive element count)")
    if model.tp > 1 and model.autoep:
        raise ValueError("--tp with --experts: DeepSpeed refuses AutoEP combined with tensor parallelism")


def build_plan(model: Model, *, dp: int, stage: int, dtype: str = "fp32", ep: int = 1,
               sub_group_size: Optional[int] = None, data_before_expert: bool = False, seed: int = 0,
               noise: Noise, tag: Optional[str] = None) -> Plan:
    """The Plan writing ``tag/`` for an explicit model (relative paths; ``latest`` is not in it)."""
    check_topology(model, dp=dp, stage=stage, dtype=dtype, ep=ep, sub_group_size=sub_group_size)
    tag = tag or f"global_step{records.GLOBAL_STEPS}"
    return _write(ZeroWriter(model, Topology(dp, ep, data_before_expert), stage, dtype, sub_group_size, noise, seed, tag))


def _write(writer: "ZeroWriter") -> Plan:
    """Runs the writer; returns what it has not flushed (everything, when it has no flush)."""
    if writer.stage == 3:
        writer.write_zero3()
    else:
        writer.write_zero12()
    return writer.plan


def make_checkpoint(out, *, params="1B", dp: int, stage: int, dtype: str = "fp32", layers: Optional[int] = None,
                    hidden: Optional[int] = None, experts: int = 0, ep: int = 1, moe_layers: int = 0,
                    sub_group_size: Optional[int] = None, data_before_expert: bool = False, seed: int = 0,
                    workers: Optional[int] = None, model: Optional[Model] = None, overwrite: bool = False,
                    report: Optional[dict] = None, tp: int = 1, family: str = "toy", heads: Optional[int] = None,
                    kv_heads: Optional[int] = None, dense_layers: int = 3, vocab: Optional[int] = None) -> Path:
    """Write a DeepSpeed 0.19.8 ZeRO checkpoint under ``out``; returns the tag folder.

    ``params`` is the target parameter count (an int or '1B', the default); ``layers``/``hidden`` pin
    the depth or width, the other is solved for (with both, ``params`` is unused). ``experts > 0`` makes an AutoEP model with ``moe_layers``
    MoE layers of ``experts`` experts over ``ep`` EP ranks (``moe_layers`` defaults to 2). ``tp > 1``
    makes a Megatron-style tensor-parallel model (:func:`tp_model`), one set of files per tp rank.
    ``family`` picks a realistic layout instead of the toy one: ``llama`` (:func:`llama_model`, also
    with ``tp``), ``mixtral`` and ``deepseek`` (AutoEP, :func:`mixtral_model`, :func:`deepseek_model`;
    ``experts`` defaults to 8 and 256), shaped by ``heads``, ``kv_heads``, ``dense_layers``, ``vocab``. ``model``
    overrides the sizing with an explicit :class:`Model`. ``report``, if given, receives the
    model's numel, bytes written, file count and seconds.
    """
    t0 = time.perf_counter()
    out = Path(out)
    if model is None:
        if family in ("mixtral", "deepseek"):
            experts = experts or FAMILY_EXPERTS[family]
        elif family != "toy":
            if experts or ep != 1:
                raise ValueError(f"--family {family} is dense: --experts/--ep need --family mixtral or deepseek")
        elif experts:
            moe_layers = moe_layers or 2
        elif moe_layers or ep != 1:
            raise ValueError("--ep and --moe-layers need --experts")
        if tp < 1:
            raise ValueError(f"--tp must be positive, not {tp}")
        if tp > 1 and experts:
            raise ValueError("--tp with --experts: DeepSpeed refuses AutoEP combined with tensor parallelism")
        model = size_model(parse_count(params), layers, hidden, experts, ep, moe_layers, tp, family, heads=heads,
                           kv_heads=kv_heads, dense_layers=dense_layers, vocab=vocab)
    check_topology(model, dp=dp, stage=stage, dtype=dtype, ep=ep, sub_group_size=sub_group_size)
    tag = f"global_step{records.GLOBAL_STEPS}"
    tag_dir = out / tag
    if tag_dir.exists():
        if not overwrite:
            raise FileExistsError(f"{tag_dir} exists (pass overwrite=True / --overwrite to replace it)")
        shutil.rmtree(tag_dir)
    out.mkdir(parents=True, exist_ok=True)
    noise_path = out / f".make_checkpoint-noise-{os.getpid()}.bin"
    try:
        noise = Noise(str(noise_path), seed)
        writer = ZeroWriter(model, Topology(dp, ep, data_before_expert), stage, dtype, sub_group_size, noise, seed, tag)
        result = {"bytes_written": 0, "files": 0}
        busy = [0.0]  # seconds in the executor (the rest is planning and pickling)

        def flush(plan: Plan) -> None:
            if not (plan.archives or plan.raw_files or plan.copies):
                return
            t = time.perf_counter()
            done = execute(plan, str(out), workers)
            for key in result:
                result[key] += done[key]
            busy[0] += time.perf_counter() - t

        writer.flush = flush
        flush(_write(writer))
        t1 = time.perf_counter() - busy[0]
        for script in _recovery_scripts():  # plain files, not checkpoint archives: copied as they are
            shutil.copy2(script, out / os.path.basename(script))
    finally:
        if noise_path.exists():
            noise_path.unlink()
    (out / "latest").write_text(tag)  # DeepSpeed writes the tag with no newline
    if report is not None:
        report.update(numel=model.numel(), bytes=result["bytes_written"], files=result["files"],
                      plan_seconds=t1 - t0, seconds=time.perf_counter() - t0, model=model)
    return tag_dir
