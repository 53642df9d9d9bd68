"""Consolidated export: a DeepSpeed ZeRO checkpoint → Hugging Face model files (safetensors), complete or absent.

What ``zero_to_fp32.py --safe_serialization`` writes, without assembling any tensor in memory:
each shard is a safetensors header computed here followed by tensor bytes the native executor
gathers from the memory-mapped ZeRO shards, cast to the export dtype in the same pass. The
output is staged and renamed into place like a conversion's; no pointer file is written.
A Universal Checkpoint made from a ZeRO checkpoint exports to the same files: its ``fp32.pt``
tensors and copied model states hold the same state dict (:mod:`pyckpt.universal.read`).
"""

from __future__ import annotations

import json
import os
import reprlib
import time
from dataclasses import dataclass
from collections import OrderedDict
from typing import Callable, Dict, Optional, Tuple, Union

from ..zero.consolidated import cast, consolidate
from ..tensors import dtype_named, FLOATING, ITEMSIZE
from ..zero.discovery import discover
from ..zero.names import check_tag
from ..universal.read import consolidate_universal, discover_universal, find_universal_folder
from .autoep_names import preset_of, to_hf_names
from ..errors import CheckpointFormatError, UnsupportedCheckpointError, check_workers, metadata_errors
from ..execution.distributed import several
from ..execution.publish import agreed_plan, write_published
from ..execution.report import WrittenReport
from ..formats.safetensors import RESERVED_NAME, TensorEntry, layout
from ..planning.collector import pauses_collector
from ..formats.confined import read_inside
from ..formats.json_file import read_json_object
from .files import (COMPANION_FILES, CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME,
                                 WEIGHTS_INDEX_NAME, WEIGHTS_NAME)
from .shards import parse_size, split
from ..planning.plan import Plan

# Each companion (huggingface.files.COMPANION_FILES) must be a regular file inside the checkpoint's
# folder (formats.confined): one that links out of it, or into a kernel pseudo-filesystem, stops the
# export, since whatever it names would be published.
COMPANION_MAX_BYTES = 64 * 1024 * 1024
# the config is parsed, not only copied: kilobytes in practice, a megabyte with a vision model's labels
CONFIG_MAX_BYTES = 16 * 1024 * 1024


@dataclass
class ExportReport(WrittenReport):
    input: str
    output: str
    dtype: str
    tensors: int
    files: int
    total_size: int
    bytes_written: int = 0
    seconds: float = 0.0
    plan_text: str = ""

    def summary(self) -> str:
        return f"exported {self.tensors} tensors ({self.dtype}) to {self.output}: {self.files} files, {self.written()}"


def resolve_dtype(dtype: str, config: Optional[dict] = None) -> str:
    """The export's torch dtype name; ``auto`` takes the model config's dtype, else float32."""
    if dtype == "auto":
        named = (config or {}).get("dtype") or (config or {}).get("torch_dtype")
        return (dtype_named(named) or "float32") if named else "float32"
    if dtype_named(dtype) is None:
        raise ValueError(f"dtype {dtype!r} is not one of fp32, bf16, fp16, auto")
    return dtype_named(dtype)


@pauses_collector
def plan_export(input, dtype: str = "fp32", max_shard_size: Union[int, str] = "5GB",
                exclude_frozen: bool = False, dense_only: bool = False, tag: Optional[str] = None,
                torch_bin: bool = False):
    """(plan, report fields) of an export, nothing written."""
    ck, state = read_consolidated(input, tag, exclude_frozen, dense_only)
    companions = companion_folder(ck.folder)
    config, config_bytes = read_model_config(companions)
    target = resolve_dtype(dtype, config)
    limit = parse_size(max_shard_size)
    named = _hf_module_names(ck, state, config, plan_notes := [])
    tensors = {name: cast(t, target) if t.dtype in FLOATING else t for name, t in named.items()}
    for name, t in tensors.items():
        if t.dtype not in ITEMSIZE:
            raise CheckpointFormatError(f"{ck.folder}: {name} has dtype {t.dtype}, which safetensors cannot hold")
    nbytes = {k: t.numel() * ITEMSIZE[t.dtype] for k, t in tensors.items()}
    plan = Plan()
    plan.notes.extend(plan_notes)
    if torch_bin:
        # torch.save keeps shared storage: an alias is the same tensor as its holder, one storage in
        # the holder's file (what zero_to_fp32 writes without --safe_serialization)
        keys = list(tensors) + list(state.aliases)
        shards = split(keys, nbytes, state.aliases, limit, WEIGHTS_NAME)
        for fname, names in shards.files.items():
            plan.add_archive(fname, OrderedDict((n, tensors[state.aliases.get(n, n)]) for n in names))
        index_name = WEIGHTS_INDEX_NAME
    else:
        # safetensors holds no shared storage: tied aliases are left out, as save_pretrained leaves
        # them out, and the model re-ties them on load.
        if RESERVED_NAME in tensors:
            raise UnsupportedCheckpointError(f"{ck.folder}: parameter {RESERVED_NAME!r} cannot be stored in a "
                                             "safetensors file, where that name is the header's metadata key; "
                                             "export with --torch-bin (pytorch_model.bin) instead")
        shards = split(list(tensors), nbytes, {}, limit, SAFE_WEIGHTS_NAME)
        for fname, names in shards.files.items():
            lay = layout([TensorEntry(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in names], {"format": "pt"})
            plan.add_raw_file(fname, lay.header, [(e.name, tensors[e.name]) for e in lay.order])
        index_name = SAFE_WEIGHTS_INDEX_NAME
    if shards.sharded:
        plan.add_raw_file(index_name, shards.index_json())
    if state.aliases and not torch_bin:
        plan.notes.append(f"  tied aliases left out of safetensors (re-tied on load): {', '.join(state.aliases)}")
    _add_companions(plan, companions, config, config_bytes, target)
    return ck, plan, target, len(shards.weight_map()), shards.total_size


def read_consolidated(input, tag: Optional[str] = None, exclude_frozen: bool = False, dense_only: bool = False):
    """(checkpoint, zero_to_fp32's state dict as byte pieces) of INPUT: a ZeRO checkpoint (tag folder, or the
    folder holding ``latest``) or a Universal Checkpoint made from one (its folder, or the folder holding
    ``latest_universal``), which gives the same state dict (``deepspeed.universal_read``)."""
    path = _tagged(input, tag)
    with metadata_errors(input):
        universal = find_universal_folder(path)
        ck = discover_universal(universal) if universal else discover(path)
    with metadata_errors(ck.folder):
        if universal:
            return ck, consolidate_universal(ck, exclude_frozen=exclude_frozen, dense_only=dense_only)
        return ck, consolidate(ck, exclude_frozen=exclude_frozen, dense_only=dense_only)


def autoep_naming(ck, state, config: Optional[dict], notes: list, required: bool = False) -> Optional[tuple]:
    """(AutoEP layers, preset) when the checkpoint's AutoEP layers go back under the Hugging Face
    names of the model type the config beside it names (``deepspeed.autoep.hf_names``); None when it
    has no AutoEP layer or no mapping is known (``notes`` says which), an error naming why when the
    caller ``required`` the names (the DCP export's ``--hf-names``)."""
    def unnamed(why: str):
        if required:
            raise UnsupportedCheckpointError(f"{ck.folder}: --hf-names asks for the AutoEP layers under their Hugging "
                                             f"Face names, but {why}")
        return None

    layers = next((ms.autoep_layers for ms in ck.model if ms.autoep_layers is not None), None)
    if not layers:
        return unnamed("it has no AutoEP layer")
    for entry in layers:
        if not (isinstance(entry, dict) and isinstance(entry.get("module_path"), str)
                and isinstance(entry.get("expert_key_prefix"), str)):
            raise CheckpointFormatError(f"{ck.model[0].path}: an ds_autoep_layers entry lacks its module_path or "
                                        "expert_key_prefix")
    preset = preset_of(config)
    if preset is None:
        kind = (config or {}).get("model_type")
        why = ("no config.json beside the checkpoint" if config is None
               else f"model_type {reprlib.repr(kind)} has no mapping")
        notes.append(f"  AutoEP layers kept under their AutoEP names (router.gate, experts.w1/w2/w3): {why}")
        return unnamed(why)
    renamed = set(state.aliases.values()) & {name for e in layers for name in state.tensors
                                             if name.startswith(e["module_path"] + ".")}
    if renamed:
        raise UnsupportedCheckpointError(f"{ck.folder}: {sorted(renamed)[0]} is both an AutoEP weight and shared "
                                         "with another parameter")
    notes.append(f"  AutoEP layers under the Hugging Face names of model_type {config['model_type']!r} "
                 f"({preset[0]}, {preset[1]}.gate_up_proj, {preset[1]}.down_proj)")
    return layers, preset


def _hf_module_names(ck, state, config: Optional[dict], notes: list):
    """The state dict's tensors, AutoEP layers under their Hugging Face names where known."""
    naming = autoep_naming(ck, state, config, notes)
    return state.tensors if naming is None else to_hf_names(state.tensors, *naming, ck.folder)


def companion_folder(tag_folder: str) -> str:
    """Where the model's config and tokenizer lie: in the tag folder itself (pyckpt's save glue puts
    them there), else beside it (the Hugging Face Trainer's checkpoint-N/ holds them next to
    global_stepN/)."""
    if any(os.path.lexists(os.path.join(tag_folder, name)) for name in COMPANION_FILES):
        return tag_folder
    return os.path.dirname(tag_folder)


def _add_companions(plan: Plan, folder: str, config: Optional[dict], config_bytes: Optional[bytes],
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


def _tagged(input, tag: Optional[str]):
    """INPUT/TAG when a tag is named (zero_to_fp32's -t): one folder name inside INPUT."""
    if tag is None:
        return input
    check_tag(tag, os.path.join(os.fspath(input), "(--tag)"))
    return os.path.join(os.fspath(input), tag)


def export_hf(input, output, *, tag: Optional[str] = None, dtype: str = "fp32",
              max_shard_size: Union[int, str] = "5GB", torch_bin: bool = False,
              exclude_frozen_parameters: bool = False, dense_only: bool = False, overwrite: bool = False,
              dry_run: bool = False, workers: Optional[int] = None, progress: bool = False, fsync: bool = False,
              notify: Optional[Callable[[str], None]] = None, ranks=None) -> ExportReport:
    """Export a DeepSpeed ZeRO checkpoint (tag folder, or the folder holding ``latest``) as Hugging Face
    safetensors model files in the new folder ``output``. ``input`` may also be a Universal Checkpoint
    converted from one (its folder, or the folder holding ``latest_universal``): the files are the same.

    The state dict is ``zero_to_fp32``'s: persistent buffers, frozen parameters (unless
    ``exclude_frozen_parameters``), trainable parameters from their fp32 masters, in that order;
    tied aliases are left out of safetensors as ``save_pretrained`` leaves them out. ``dtype`` is
    fp32, bf16, fp16 or auto (the config.json's dtype beside the checkpoint, else fp32); integer
    buffers keep their dtype. Files are split by ``max_shard_size`` as ``huggingface_hub`` splits
    them, with an index when there is more than one. ``torch_bin`` writes ``pytorch_model*.bin``
    (torch.save files, aliases kept as shared storage) instead. The output is complete or absent; an existing
    ``output`` is replaced only with ``overwrite=True``.

    ``ranks``: several processes share the files, as for
    :func:`pyckpt.universal.convert.convert_to_universal`; each file is written by one process, so only a
    sharded export (``max_shard_size`` below the model's size) is spread.
    """
    t0 = time.perf_counter()
    check_workers(workers)
    ranks = several(ranks)
    output = os.path.abspath(os.fspath(output))
    ck, plan, target, count, total = agreed_plan(
        ranks, "planning the export", input, output, dry_run,
        lambda: plan_export(input, dtype, max_shard_size, exclude_frozen_parameters, dense_only, tag, torch_bin))
    report = ExportReport(ck.folder, output, target, count, len(plan.raw_files) + len(plan.archives), total)
    if dry_run:
        report.plan_text = plan.describe()
        return report
    stats = write_published(plan, output, overwrite=overwrite, fsync=fsync, pointer=None, workers=workers,
                            progress=progress, notify=notify, ranks=ranks)
    report.bytes_written = stats["bytes_written"]
    report.seconds = time.perf_counter() - t0
    return report


def read_model_config(folder: str) -> Tuple[Optional[Dict], Optional[bytes]]:
    """The model config beside the checkpoint, parsed, and its bytes (None, None if absent). It is
    read confined to ``folder`` and parsed by the strict JSON reader
    (:func:`~pyckpt.formats.json_file.read_json_object`): NaN, infinities, deep nesting, long
    integers, duplicate keys or a top level other than an object are one error naming the file."""
    if not os.path.lexists(os.path.join(folder, CONFIG_NAME)):
        return None, None
    return read_json_object(folder, CONFIG_NAME, "model config", CONFIG_MAX_BYTES)
