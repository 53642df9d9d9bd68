"""What rank 0 writes beside DeepSpeed's files: tokenizer, model config, a readable training state.

They go into the checkpoint's own folder, so each checkpoint is complete by itself and appears
together with DeepSpeed's files (or not at all); ``pyckpt export`` takes them from there into a
Hugging Face folder. The tokenizer goes through ``save_pretrained`` (DeepSpeed-Chat's
``save_vocabulary`` loses added and special tokens).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
from typing import Any, Optional

from ...huggingface.files import CONFIG_NAME

TRAINING_STATE = "training_state.json"


def write_tokenizer(tokenizer, folder: str) -> None:
    if not hasattr(tokenizer, "save_pretrained"):
        raise TypeError(f"tokenizer must have save_pretrained (a transformers tokenizer), not {type(tokenizer).__name__}")
    tokenizer.save_pretrained(folder)


def write_model_config(config, folder: str) -> None:
    """A transformers config (``save_pretrained``) or a plain dict, as ``config.json``."""
    if hasattr(config, "save_pretrained"):
        config.save_pretrained(folder)
        return
    if not isinstance(config, dict):
        raise TypeError("model_config must be a transformers config (with save_pretrained) or a dict, not "
                        f"{type(config).__name__}")
    _write_json(os.path.join(folder, CONFIG_NAME), config)


def _write_json(path: str, value: Any) -> None:
    data = json.dumps(value, indent=2, sort_keys=True, default=str) + "\n"
    with open(path, "x", encoding="utf-8") as f:
        f.write(data)


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON-ready data: tensors become numbers (or their shape when large), anything
    unknown its repr; a scheduler state dict holds all of these."""
    if depth > 8:
        return repr(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, dict):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    if hasattr(value, "numel") and hasattr(value, "tolist"):
        return _plain(value.tolist(), depth + 1) if value.numel() <= 16 else f"tensor{tuple(value.shape)}"
    return repr(value)


def _version(module: str) -> Optional[str]:
    """The loaded module's own version string (metadata lookups cost tens of milliseconds each)."""
    found = sys.modules.get(module)
    return getattr(found, "__version__", None) if found is not None else None


def training_state(engine, tag: str, world_size: int) -> dict:
    """The run's position and settings, for a person (or a script) looking at the folder."""
    opt = engine.optimizer
    groups = getattr(opt, "param_groups", None) or []
    scheduler = getattr(engine, "lr_scheduler", None)
    pp = getattr(engine, "num_stages", 1)
    state = {
        "tag": tag,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "global_steps": int(engine.global_steps),
        "global_samples": int(engine.global_samples),
        "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
        "learning_rates": [_plain(g.get("lr")) for g in groups],
        "lr_scheduler": _plain(scheduler.state_dict()) if scheduler is not None and hasattr(scheduler, "state_dict")
        else None,
        "zero_stage": int(engine.zero_optimization_stage()),
        "world": {
            "world_size": world_size,
            "data_parallel": int(engine.dp_world_size),
            "model_parallel": int(engine.mp_world_size),
            "pipeline_parallel": int(pp),
        },
        "versions": {
            "deepspeed": _version("deepspeed"),
            "torch": _version("torch"),
            "pyckpt": _version("pyckpt"),  # imported: this module is part of it
            "python": platform.python_version(),
        },
    }
    return state


def write_training_state(engine, tag: str, world_size: int, folder: str) -> None:
    _write_json(os.path.join(folder, TRAINING_STATE), training_state(engine, tag, world_size))


def write_companions(engine, folder: str, tag: str, world_size: int, tokenizer, model_config, failures,
                     training_state: bool = True) -> None:
    """Rank 0: the tokenizer, the model config and ``training_state.json`` into ``folder`` (the staging
    folder); the first that fails is recorded in ``failures`` (a :class:`~.guarded_io.WriteFailures`)
    and the rest are not written."""
    steps = [("writing the tokenizer into", lambda: tokenizer is not None and write_tokenizer(tokenizer, folder)),
             ("writing the model config into",
              lambda: model_config is not None and write_model_config(model_config, folder)),
             ("writing training_state.json into",
              lambda: training_state and write_training_state(engine, tag, world_size, folder))]
    for action, step in steps:
        try:
            step()
        except Exception as exc:
            failures.record(action, folder, exc)
            return
