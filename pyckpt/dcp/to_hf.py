"""A torch.distributed.checkpoint (DCP) folder -> Hugging Face model files, complete or absent.

What FSDP2 and torchtitan users do today with ``dcp_to_torch_save`` + ``save_pretrained`` (the whole
model in one process) or torchtitan's conversion script (the whole model built in memory), done as a
plan of byte copies: each tensor's chunks in the ``.distcp`` files become pieces of the safetensors
shards, cast to the export dtype on the way; nothing is assembled in memory.

The model is the entries under ``model_key`` (get_state_dict's ``{"model": ..., "optim": ...}``), or
the top-level tensors of a model-only save and of torchtitan's checkpointer, which puts the model's
entries at the top level. Their names are the state dict's, the Hugging Face names for a transformers
model trained with FSDP2; ``from_torchtitan`` maps torchtitan's Llama3 names and row order back
(:mod:`.torchtitan`). A config whose ``tie_word_embeddings`` is true makes ``lm_head.weight`` an alias
of the input embedding, left out of safetensors as ``save_pretrained`` leaves it out.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

from ..errors import CheckpointFormatError, UnsupportedCheckpointError, metadata_errors, quoted
from ..execution.writer_run import run_writer
from ..formats.json_file import read_json_object
from ..huggingface.companions import CONFIG_MAX_BYTES, companion_folder
from ..huggingface.export import ExportReport, plan_model_files
from ..huggingface.export import export_hf as export_zero_hf
from ..huggingface.files import COMPANION_FILES, CONFIG_NAME
from ..planning.collector import pauses_collector
from ..tensors import NewTensor
from .read import DcpCheckpoint, read_dcp
from .torchtitan import Heads, from_torchtitan_model

AUTO = "auto"
# Where a state dict's input embedding lives in the model families transformers ties lm_head to.
_INPUT_EMBEDDINGS = ("model.embed_tokens.weight", "transformer.wte.weight", "model.decoder.embed_tokens.weight",
                     "gpt_neox.embed_in.weight", "transformer.word_embeddings.weight")
_OUTPUT_EMBEDDING = "lm_head.weight"


@dataclass
class DcpModel:
    """The model part of a DCP checkpoint: name -> DCP key, in the checkpoint's order."""

    key: str  # the model key used ('' for the top level)
    names: "OrderedDict[str, str]"


def model_entries(ck: DcpCheckpoint, model_key: str = AUTO) -> DcpModel:
    """The tensors of the model part: under ``model_key`` (their names the rest of their path), or with
    ``''`` the top-level tensors; ``auto`` takes "model" where the checkpoint has it, else the top level."""
    if model_key == AUTO:
        model_key = "model" if any(len(t.path) > 1 and t.path[0] == "model" for t in ck.tensors.values()) else ""
    names: "OrderedDict[str, str]" = OrderedDict()
    for key, t in ck.tensors.items():
        if model_key == "":
            if len(t.path) == 1:
                names[str(t.path[0])] = key
        elif len(t.path) > 1 and t.path[0] == model_key:
            names[".".join(str(p) for p in t.path[1:])] = key
    if not names:
        tops = sorted({str(e.path[0]) for e in list(ck.tensors.values()) + list(ck.objects.values())})
        where = "at the top level" if model_key == "" else f"under {quoted(model_key)}"
        raise CheckpointFormatError(f"{ck.folder}: no tensors {where}; the checkpoint's top-level keys are "
                                    f"{', '.join(quoted(top, 60) for top in tops[:20])}"
                                    f"{' ...' if len(tops) > 20 else ''} "
                                    "(choose one with --model-key)")
    return DcpModel(model_key, names)


def config_folder(ck_folder: str, config: Optional[str]) -> Tuple[Optional[str], Optional[dict], Optional[bytes]]:
    """(folder whose companions are copied, parsed config, its bytes): ``config`` (a folder, or a
    config.json path), else the DCP folder or its parent where either holds a config.json or tokenizer."""
    if config is not None:
        config = os.path.abspath(os.fspath(config))
        folder = os.path.dirname(config) if os.path.isfile(config) else config
        name = os.path.basename(config) if os.path.isfile(config) else CONFIG_NAME
        if not os.path.lexists(os.path.join(folder, name)):
            raise CheckpointFormatError(f"{os.path.join(folder, name)}: no such model config")
        parsed, raw = read_json_object(folder, name, "model config", CONFIG_MAX_BYTES)
        return (folder if name == CONFIG_NAME else None), parsed, raw
    folder = companion_folder(ck_folder)
    if not any(os.path.lexists(os.path.join(folder, n)) for n in COMPANION_FILES):
        return None, None, None
    if not os.path.lexists(os.path.join(folder, CONFIG_NAME)):
        return folder, None, None
    parsed, raw = read_json_object(folder, CONFIG_NAME, "model config", CONFIG_MAX_BYTES)
    return folder, parsed, raw


def tied_aliases(tensors: "OrderedDict[str, NewTensor]", config: Optional[dict], notes: List[str]):
    """{lm_head.weight: the input embedding} where the config ties them and both are present."""
    if not config or config.get("tie_word_embeddings") is not True or _OUTPUT_EMBEDDING not in tensors:
        return OrderedDict()
    holders = [n for n in _INPUT_EMBEDDINGS if n in tensors]
    if len(holders) != 1 or tuple(tensors[holders[0]].shape) != tuple(tensors[_OUTPUT_EMBEDDING].shape):
        notes.append(f"  config ties the embeddings, but no input embedding of {_OUTPUT_EMBEDDING}'s shape was found: "
                     "both are written")
        return OrderedDict()
    return OrderedDict([(_OUTPUT_EMBEDDING, holders[0])])


@pauses_collector
def plan_dcp_hf(input, model_key: str = AUTO, dtype: str = "fp32", max_shard_size: Union[int, str] = "5GB",
                from_torchtitan: bool = False, config: Optional[str] = None, torch_bin: bool = False):
    """(checkpoint, plan, dtype, tensors, total bytes) of a DCP -> Hugging Face export, nothing written."""
    folder = os.path.abspath(os.fspath(input))
    with metadata_errors(folder):
        ck = read_dcp(folder)
        model = model_entries(ck, model_key)
        companions, parsed, raw = config_folder(folder, config)
        tensors = ck.assemble(model.names.values())
        named = OrderedDict((name, tensors[key]) for name, key in model.names.items())
        notes: List[str] = [f"  model: {len(named)} tensors " + (f"under {quoted(model.key)}" if model.key else
                                                                  "at the top level")]
        if from_torchtitan:
            if parsed is None:
                raise UnsupportedCheckpointError(f"{folder}: --from-torchtitan needs the Hugging Face config.json of "
                                                 "the model (--config): torchtitan's checkpoint does not say its "
                                                 "attention shape in Hugging Face terms")
            named = from_torchtitan_model(named, Heads(parsed, folder, os.path.join(companions or folder,
                                                                                      CONFIG_NAME)))
        aliases = tied_aliases(named, parsed, notes)
        for alias in aliases:
            named.pop(alias)
        plan, target, count, total = plan_model_files(folder, named, aliases, companions, parsed, raw, dtype,
                                                      max_shard_size, torch_bin, notes)
    return ck, plan, target, count, total


def export_hf_from_dcp(input, output, *, model_key: str = AUTO, dtype: str = "fp32",
                       max_shard_size: Union[int, str] = "5GB", from_torchtitan: bool = False,
                       config: Optional[str] = None, torch_bin: bool = False, overwrite: bool = False,
                       dry_run: bool = False, workers: Optional[int] = None, progress: bool = False,
                       fsync: bool = False, notify: Optional[Callable[[str], None]] = None,
                       ranks=None) -> ExportReport:
    """Export the model of the DCP checkpoint ``input`` (FSDP2's ``dcp.save``, torchtitan's checkpointer) as
    Hugging Face model files in the new folder ``output``: model.safetensors, or shards and their index split
    by ``max_shard_size``, each tensor reassembled from its chunks by byte copies and cast to ``dtype`` (fp32,
    bf16, fp16, or auto: the config's). ``model_key`` picks the model entries (see :func:`model_entries`);
    ``config`` names the model's config.json (or its folder, whose tokenizer files are copied too), else one
    beside ``input`` is used; ``from_torchtitan`` maps a torchtitan Llama3 model back to the Hugging Face
    Llama names (needs the config). Complete or absent; ``overwrite`` replaces an existing ``output``."""
    def make_report(planned, output):
        ck, plan, target, count, total = planned
        return ExportReport(ck.folder, output, target, count, len(plan.raw_files) + len(plan.archives), total)

    return run_writer("export", input, output,
                      lambda output, ranks: plan_dcp_hf(input, model_key, dtype, max_shard_size, from_torchtitan,
                                                        config, torch_bin),
                      make_report, pointer=None, overwrite=overwrite, dry_run=dry_run, workers=workers,
                      progress=progress, fsync=fsync, notify=notify, ranks=ranks)

