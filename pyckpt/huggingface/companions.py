"""The files a Hugging Face model folder takes from beside the checkpoint: where they lie, the model
config as parsed (its dtype decides an export's ``auto``), and their copy into an export's plan.

Each companion (:data:`pyckpt.huggingface.files.COMPANION_FILES`) must be a regular file inside the
checkpoint's folder (:mod:`pyckpt.formats.confined`): one that links out of it, or into a kernel
pseudo-filesystem, stops the export, since whatever it names would be published.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Optional, Tuple

from ..formats.confined import read_inside
from ..formats.json_file import read_json_object
from ..planning.plan import Plan
from ..tensors import dtype_named
from .files import COMPANION_FILES, CONFIG_NAME

COMPANION_MAX_BYTES = 64 * 1024 * 1024
# the config is parsed, not only copied: kilobytes in practice, a megabyte with a vision model's labels
CONFIG_MAX_BYTES = 16 * 1024 * 1024


def companion_folder(tag_folder: str) -> str:
    """Where the model's config and tokenizer lie: in the tag folder itself (pyckpt's save glue puts
    them there), else beside it (the Hugging Face Trainer's checkpoint-N/ holds them next to
    global_stepN/)."""
    if any(os.path.lexists(os.path.join(tag_folder, name)) for name in COMPANION_FILES):
        return tag_folder
    return os.path.dirname(tag_folder)


def read_model_config(folder: str) -> Tuple[Optional[Dict], Optional[bytes]]:
    """The model config beside the checkpoint, parsed, and its bytes (None, None if absent). It is
    read confined to ``folder`` and parsed by the strict JSON reader
    (:func:`~pyckpt.formats.json_file.read_json_object`): NaN, infinities, deep nesting, long
    integers, duplicate keys or a top level other than an object are one error naming the file."""
    if not os.path.lexists(os.path.join(folder, CONFIG_NAME)):
        return None, None
    return read_json_object(folder, CONFIG_NAME, "model config", CONFIG_MAX_BYTES)


def resolve_dtype(dtype: str, config: Optional[dict] = None) -> str:
    """The export's torch dtype name; ``auto`` takes the model config's dtype, else float32."""
    if dtype == "auto":
        named = (config or {}).get("dtype") or (config or {}).get("torch_dtype")
        return (dtype_named(named) or "float32") if named else "float32"
    if dtype_named(dtype) is None:
        raise ValueError(f"dtype {dtype!r} is not one of fp32, bf16, fp16, auto")
    return dtype_named(dtype)


def add_companions(plan: Plan, folder: str, config: Optional[dict], config_bytes: Optional[bytes],
                    target: str) -> None:
    """The model's config and tokenizer files from beside the checkpoint; the config says the
    export's dtype when it named another (from_pretrained would otherwise cast on load)."""
    for name in COMPANION_FILES:
        path = os.path.join(folder, name)
        if not os.path.lexists(path):
            continue
        plan.input_files.append(path)
        # the config as parsed, not read again: the copy says what the dtype decision saw
        data = config_bytes if name == CONFIG_NAME else read_inside(folder, name, COMPANION_MAX_BYTES)
        if name == CONFIG_NAME and config is not None:
            keys = [k for k in ("dtype", "torch_dtype") if k in config]
            # A config naming no dtype is a float32 model to from_pretrained (transformers leaves the
            # key out for a model built without one); any other export dtype is then written in.
            stale = (any(str(config[k]).replace("torch.", "") != target for k in keys) if keys
                     else target != "float32")
            keys = keys or ["dtype"]
            if stale:
                config = dict(config)
                for k in keys:
                    config[k] = target
                # transformers writes configs this way (PretrainedConfig.to_json_string)
                data = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8")
                plan.notes.append(f"  {CONFIG_NAME}: dtype set to {target}")
        plan.add_raw_file(name, data)
