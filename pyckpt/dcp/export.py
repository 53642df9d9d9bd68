"""Export to torch.distributed.checkpoint: a DeepSpeed checkpoint -> a DCP folder that
``torch.distributed.checkpoint.load`` reads into an FSDP2 model and a torch Adam/AdamW optimizer,
weights and optimizer state together, complete or absent.

The content is what ``get_state_dict(model, optimizer)`` gives for the same model under FSDP2,
nested as ``{model_key: model state dict, optim_key: {"state": ..., "param_groups": ...}}``:
- the model's entries are the consolidated state dict an export writes (buffers, frozen parameters,
  trainable parameters from their fp32 masters; a tied parameter under each of its names, the second
  sharing the first one's chunks), in ``dtype``;
- ``state.<fqn>.{step, exp_avg, exp_avg_sq}`` for every trainable parameter, the fp32 moments of the
  ZeRO partitions (the Universal Checkpoint's own bytes) and torch's float32 step;
- ``param_groups``: DeepSpeed's groups in order, each with its own hyper-parameters and its
  parameters by name.
Nothing is assembled in memory: each chunk is a torch.save archive whose tensor bytes the native
executor gathers from the mapped shards (:mod:`.layout` says how tensors are cut), and the
``.metadata`` is pickled by pyckpt (:mod:`.metadata`). The optimizer's translation into torch Adam's
state is :mod:`.optimizer`'s.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from typing import Callable, Dict, Optional

from ..errors import CheckpointFormatError, check_number, quoted
from ..execution.executor import series_locations
from ..execution.writer_run import run_writer
from ..execution.report import WrittenReport
from ..huggingface.autoep_names import autoep_naming, to_hf_names
from ..huggingface.files import CONFIG_NAME
from ..huggingface.companions import companion_folder, read_model_config, resolve_dtype
from ..planning.collector import pauses_collector
from ..planning.plan import Plan
from ..tensors import FLOATING, ITEMSIZE, numel
from ..universal.input import read_consolidated
from ..zero.consolidated import cast
from .layout import (DEFAULT_CHUNK_BYTES, MODEL_KEY, OPTIM_KEY, OPTIM_LAYOUTS, TORCHTITAN_LAYOUT, Layout, TensorEntry,
                     assign_files, chunk_tensor, data_file_name, torchtitan_options_problem)
from .metadata import metadata_bytes
from .optimizer import add_optimizer
from .torchtitan import Heads, to_torchtitan_model, torchtitan_name

METADATA_NAME = ".metadata"
# The export's options beside the DCP files, for verify
EXPORT_RECORD = ".pyckpt-export.json"
EXPORT_RECORD_VERSION = 1
# No file holds more bytes than an off_t counts: a larger chunk is a typo (and would not fit the JSON record).
CHUNK_BYTES_MAX = (1 << 63) - 1


@dataclass
class DcpReport(WrittenReport):
    input: str
    output: str
    dtype: str
    entries: int
    chunks: int
    files: int
    total_size: int
    bytes_written: int = 0
    seconds: float = 0.0
    plan_text: str = ""

    def summary(self) -> str:
        return (f"exported {self.entries} entries ({self.dtype} model, {self.chunks} chunks) to {self.output} as a "
                f"torch.distributed.checkpoint: {self.files} files, {self.written()}")


@pauses_collector
def plan_dcp(input, *, tag: Optional[str] = None, dtype: str = "fp32", optimizer: bool = True,
             model_key: str = MODEL_KEY, optim_key: str = OPTIM_KEY, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
             exclude_frozen: bool = False, hf_names: bool = False, optim_layout: str = "nested",
             min_files: int = 1, save_id: str = "", torchtitan: bool = False, initial_lr: Optional[float] = None):
    """(checkpoint, plan, layout, dtype) of a DCP export, nothing written."""
    problem = torchtitan_options_problem(torchtitan, hf_names, model_key, optim_key, optim_layout)
    if problem:
        raise ValueError(problem)
    if torchtitan:
        model_key, optim_key, optim_layout = TORCHTITAN_LAYOUT
    if initial_lr is not None:  # written into every param group: inf or nan would be trained from
        check_number("initial_lr", initial_lr, low=0)
    if optim_layout not in OPTIM_LAYOUTS:
        raise ValueError(f"optim_layout must be one of {', '.join(OPTIM_LAYOUTS)}, not {optim_layout!r}")
    if optimizer and not optim_key:
        raise ValueError("the optimizer state needs a key of its own (optim_key)")
    if optimizer and model_key == optim_key:
        raise ValueError(f"model_key and optim_key must differ (both {model_key!r})")
    check_number("chunk_bytes", chunk_bytes, integer=True, low=1, high=CHUNK_BYTES_MAX)
    ck, cstate = read_consolidated(input, tag, exclude_frozen, optimizer=optimizer)
    target = resolve_dtype(dtype)
    save_id = save_id or str(uuid.uuid4())
    plan = Plan()
    naming = _hf_naming(ck, cstate, plan.notes) if hf_names else None
    companions = companion_folder(ck.folder)
    if hf_names or torchtitan:  # both name tensors by the config beside the checkpoint
        plan.input_files.append(os.path.join(companions, CONFIG_NAME))
    heads = (Heads(read_model_config(companions)[0], ck.folder, os.path.join(companions, CONFIG_NAME))
             if torchtitan else None)
    model = cstate.tensors if naming is None else to_hf_names(cstate.tensors, *naming, ck.folder)
    if heads is not None:
        model = to_torchtitan_model(model, heads)
    layout = Layout()
    prefix = (model_key,) if model_key else ()
    holders: Dict[str, TensorEntry] = {}
    for name, t in model.items():
        t = cast(t, target) if t.dtype in FLOATING else t
        entry = TensorEntry(prefix + (name,), t.dtype, tuple(t.shape), chunk_tensor(t, chunk_bytes))
        holders[name] = entry
        layout.tensors.append(entry)
    for alias, holder in cstate.aliases.items():
        if heads is not None:
            alias, holder = torchtitan_name(alias, ck.folder), torchtitan_name(holder, ck.folder)
        h = holders[holder]
        layout.tensors.append(TensorEntry(prefix + (alias,), h.dtype, h.shape, [], same_as=h))
    if optimizer:
        add_optimizer(ck, cstate, layout, (optim_key,), chunk_bytes, naming, optim_layout == "flat", heads,
                      initial_lr)
    elif initial_lr is not None:
        raise ValueError("initial_lr is a value of the optimizer's param groups, which optimizer=False leaves out")
    if not model_key and optimizer and (optim_key in model or optim_key in cstate.aliases):
        raise CheckpointFormatError(f"{ck.folder}: the model has an entry named {quoted(optim_key)}, the optimizer "
                                    "state's top-level key; choose another --optim-key")
    keys = [e.key for e in layout.tensors] + [o.key for o in layout.objects]
    if len(set(keys)) != len(keys):
        seen = set()
        clash = next(k for k in keys if k in seen or seen.add(k))
        raise CheckpointFormatError(f"{ck.folder}: two entries flatten to the DCP key {quoted(clash)} (a parameter "
                                    "named like another entry's path); choose other --model-key/--optim-key")
    assign_files(layout, min_files)
    names = [data_file_name(i) for i in range(len(layout.files))]
    locations = []
    for fname, items in zip(names, layout.files):
        members = [i.tensor if hasattr(i, "tensor") else i.value for i in items]
        plan.add_archive_series(fname, members)
        locations.append(series_locations(members))
    plan.add_raw_file(METADATA_NAME, metadata_bytes(layout, locations, names, save_id))
    # what `pyckpt verify --against` needs to plan this export again (DCP's own reader ignores it)
    options = {"format": "torch.distributed.checkpoint", "written_by": "pyckpt", "version": EXPORT_RECORD_VERSION,
               "dtype": target, "optimizer": optimizer, "model_key": model_key, "optim_key": optim_key,
               "chunk_bytes": chunk_bytes, "exclude_frozen": exclude_frozen, "hf_names": hf_names,
               "optim_layout": optim_layout, "data_files": len(names),
               "save_id": save_id, "torchtitan": torchtitan, "initial_lr": initial_lr}
    plan.add_raw_file(EXPORT_RECORD, (json.dumps(options, indent=1, sort_keys=True) + "\n").encode())
    plan.notes.append(f"  torch.distributed.checkpoint: {len(layout.tensors)} tensors, {len(layout.objects)} other "
                      f"values, {sum(len(f) for f in layout.files)} archives in {len(names)} data files")
    return ck, plan, layout, target


def _hf_naming(ck, cstate, notes: list) -> tuple:
    """(AutoEP layers, preset) for ``hf_names``: the checkpoint must hold AutoEP layers of a model type
    whose Hugging Face names are known (the config beside it says which)."""
    config, _ = read_model_config(companion_folder(ck.folder))
    return autoep_naming(ck, cstate, config, notes, required=True)


def export_dcp(input, output, *, tag: Optional[str] = None, dtype: str = "fp32", optimizer: bool = True,
               model_key: str = MODEL_KEY, optim_key: str = OPTIM_KEY, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               exclude_frozen_parameters: bool = False, hf_names: bool = False, optim_layout: str = "nested",
               torchtitan: bool = False, initial_lr: Optional[float] = None,
               overwrite: bool = False, dry_run: bool = False, workers: Optional[int] = None,
               progress: bool = False, fsync: bool = False, notify: Optional[Callable[[str], None]] = None,
               ranks=None) -> DcpReport:
    """Export a DeepSpeed checkpoint (ZeRO tag folder, the folder holding ``latest`` such as the Hugging
    Face Trainer's ``checkpoint-N/``, or a Universal Checkpoint folder) as a torch.distributed.checkpoint
    folder ``output`` that ``dcp.load`` reads into an FSDP2 model and torch Adam/AdamW optimizer.

    ``dtype`` (fp32, bf16, fp16) is the model entries' (the optimizer state stays fp32);
    ``optimizer=False`` writes the model alone. ``hf_names``: AutoEP layers (router, experts) and their
    optimizer state under the Hugging Face names of the model type in the config.json beside the
    checkpoint, as the Hugging Face export writes them (a Mixtral's ``gate``, ``experts.gate_up_proj``,
    ``experts.down_proj``), for an FSDP2 job that builds the transformers model. ``optim_layout="flat"``
    writes the optimizer state as ``get_state_dict(..., options=StateDictOptions(
    flatten_optimizer_state_dict=True))`` gives it (``param_groups.<fqn>.<key>``), the layout
    torchtitan's checkpointer uses (with ``model_key=""``, ``optim_key="optimizer"``).
    ``torchtitan=True`` writes what torchtitan's checkpointer holds for its own Llama3 module trained
    from the same state (a Hugging Face Llama, as config.json beside the checkpoint says): its layout
    above, its parameter names, q and k rows in its rotary order, and the optimizer state of q, k and
    v as the one fused ``wqkv`` parameter it trains (:mod:`pyckpt.dcp.torchtitan`). ``initial_lr``
    is added to every param group (torchtitan's LR scheduler puts it there and its load asks for
    it; required with ``torchtitan`` unless DeepSpeed's groups have it).
    ``model_key``/``optim_key`` name the top-level entries (``{"model": ..., "optim": ...}`` by
    default; ``model_key=""`` puts the model's entries at the top level). ``chunk_bytes``: tensors are
    cut along dimension 0 into chunks of about this size, so a load at any world size reads little
    beyond its own rows. ``ranks`` shares the data files among the
    processes of a torch launch. The output is complete or absent; an existing ``output`` is replaced
    only with ``overwrite=True``."""
    def make_plan(output, ranks):
        # one save id for every rank's plan: the .metadata is the same file wherever it is planned
        save_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"pyckpt-dcp:{output}:{os.fspath(input)}"))
        return plan_dcp(input, tag=tag, dtype=dtype, optimizer=optimizer, model_key=model_key, optim_key=optim_key,
                        chunk_bytes=chunk_bytes, exclude_frozen=exclude_frozen_parameters, hf_names=hf_names,
                        optim_layout=optim_layout, min_files=ranks.size if ranks else 1, save_id=save_id,
                        torchtitan=torchtitan, initial_lr=initial_lr)

    def make_report(planned, output):
        ck, plan, layout, target = planned
        chunks = sum(len(f) for f in layout.files)
        total = sum(numel(c.sizes) * ITEMSIZE[c.tensor.dtype] for f in layout.files for c in f
                    if hasattr(c, "tensor"))
        return DcpReport(ck.folder, output, target, len(layout.tensors) + len(layout.objects), chunks,
                         len(plan.series) + len(plan.raw_files), total)

    return run_writer("DCP export", input, output, make_plan, make_report, pointer=None, overwrite=overwrite,
                      dry_run=dry_run, workers=workers, progress=progress, fsync=fsync, notify=notify, ranks=ranks)
