"""Consolidated export: a DeepSpeed ZeRO checkpoint → Hugging Face model files (safetensors), complete or absent.

What ``zero_to_fp32.py --safe_serialization`` writes, without assembling any tensor in memory:
each shard is a safetensors header computed here followed by tensor bytes the native executor
gathers from the memory-mapped ZeRO shards, cast to the export dtype in the same pass. The
output is staged and renamed into place like a conversion's; no pointer file is written.
A Universal Checkpoint made from a ZeRO checkpoint exports to the same files: its ``fp32.pt``
tensors and copied model states hold the same state dict (:mod:`pyckpt.universal.read`).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections import OrderedDict
from typing import Callable, Optional, Union

from ..zero.consolidated import cast
from ..tensors import FLOATING, ITEMSIZE, NewTensor
from ..universal.input import read_consolidated
from .autoep_names import autoep_naming, to_hf_names
from .companions import add_companions, companion_folder, read_model_config, resolve_dtype
from ..errors import CheckpointFormatError, UnsupportedCheckpointError
from ..execution.writer_run import run_writer
from ..execution.report import WrittenReport
from ..formats.safetensors import RESERVED_NAME, TensorEntry, layout
from ..planning.collector import pauses_collector
from .files import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME
from .shards import parse_size, split
from ..planning.plan import Plan


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


@pauses_collector
def plan_export(input, dtype: str = "fp32", max_shard_size: Union[int, str] = "5GB",
                exclude_frozen: bool = False, dense_only: bool = False, tag: Optional[str] = None,
                torch_bin: bool = False):
    """(plan, report fields) of an export, nothing written."""
    ck, state = read_consolidated(input, tag, exclude_frozen, dense_only)
    companions = companion_folder(ck.folder)
    config, config_bytes = read_model_config(companions)
    named = _hf_module_names(ck, state, config, plan_notes := [])
    plan, target, count, total = plan_model_files(ck.folder, named, state.aliases, companions, config, config_bytes,
                                                  dtype, max_shard_size, torch_bin, plan_notes)
    return ck, plan, target, count, total


def plan_model_files(folder: str, named: "OrderedDict[str, NewTensor]", aliases, companions: Optional[str],
                     config: Optional[dict], config_bytes: Optional[bytes], dtype: str = "fp32",
                     max_shard_size: Union[int, str] = "5GB", torch_bin: bool = False, notes=()):
    """(plan, dtype, tensors written, total bytes) of a Hugging Face model folder holding ``named`` (the state
    dict's tensors under their Hugging Face names; ``aliases``: name -> the entry whose tensor it is, left out of
    safetensors), cast to ``dtype``, split by ``max_shard_size``, with the companions of ``companions`` (a folder,
    or None for none). ``folder`` names the input in messages. Any reader's state goes through here: a ZeRO or
    Universal checkpoint's, a DCP checkpoint's."""
    target = resolve_dtype(dtype, config)
    limit = parse_size(max_shard_size)
    tensors = {name: cast(t, target) if t.dtype in FLOATING else t for name, t in named.items()}
    for name, t in tensors.items():
        if t.dtype not in ITEMSIZE:
            raise CheckpointFormatError(f"{folder}: {name} has dtype {t.dtype}, which safetensors cannot hold")
    nbytes = {k: t.numel() * ITEMSIZE[t.dtype] for k, t in tensors.items()}
    plan = Plan()
    plan.notes.extend(notes)
    if torch_bin:
        # torch.save keeps shared storage: an alias is the same tensor as its holder, one storage in
        # the holder's file (what zero_to_fp32 writes without --safe_serialization)
        keys = list(tensors) + list(aliases)
        shards = split(keys, nbytes, aliases, limit, WEIGHTS_NAME)
        for fname, names in shards.files.items():
            plan.add_archive(fname, OrderedDict((n, tensors[aliases.get(n, n)]) for n in names))
        index_name = WEIGHTS_INDEX_NAME
    else:
        # safetensors holds no shared storage: tied aliases are left out, as save_pretrained leaves
        # them out, and the model re-ties them on load.
        if RESERVED_NAME in tensors:
            raise UnsupportedCheckpointError(f"{folder}: parameter {RESERVED_NAME!r} cannot be stored in a "
                                             "safetensors file, where that name is the header's metadata key; "
                                             "export with --torch-bin (pytorch_model.bin) instead")
        shards = split(list(tensors), nbytes, {}, limit, SAFE_WEIGHTS_NAME)
        for fname, names in shards.files.items():
            lay = layout([TensorEntry(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in names], {"format": "pt"})
            plan.add_raw_file(fname, lay.header, [(e.name, tensors[e.name]) for e in lay.order])
        index_name = SAFE_WEIGHTS_INDEX_NAME
    if shards.sharded:
        plan.add_raw_file(index_name, shards.index_json())
    if aliases and not torch_bin:
        plan.notes.append(f"  tied aliases left out of safetensors (re-tied on load): {', '.join(aliases)}")
    if companions is not None:
        add_companions(plan, companions, config, config_bytes, target)
    return plan, target, len(shards.weight_map()), shards.total_size


def _hf_module_names(ck, state, config: Optional[dict], notes: list):
    """The state dict's tensors, AutoEP layers under their Hugging Face names where known."""
    naming = autoep_naming(ck, state, config, notes)
    return state.tensors if naming is None else to_hf_names(state.tensors, *naming, ck.folder)


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
    def make_report(planned, output):
        ck, plan, target, count, total = planned
        return ExportReport(ck.folder, output, target, count, len(plan.raw_files) + len(plan.archives), total)

    return run_writer("export", input, output,
                      lambda output, ranks: plan_export(input, dtype, max_shard_size, exclude_frozen_parameters,
                                                        dense_only, tag, torch_bin),
                      make_report, pointer=None, overwrite=overwrite, dry_run=dry_run, workers=workers,
                      progress=progress, fsync=fsync, notify=notify, ranks=ranks)
