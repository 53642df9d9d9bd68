"""Command line: ``python -m pyckpt.export INPUT OUTPUT`` and ``pyckpt export INPUT OUTPUT``.

A drop-in for DeepSpeed's ``zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR``: its flags are accepted
(``--safe_serialization`` is the default here), plus a dtype, a dry run and an overwrite.
"""

import argparse
import sys

from . import common as cli_common
from .common import UsageError, add_common_flags, note, number_flag, report_done, shard_size_flag, workers_flag

DESCRIPTION = """\
Export a DeepSpeed ZeRO (stage 1, 2 or 3) checkpoint as Hugging Face model files: model.safetensors,
or model-0000K-of-0000N.safetensors and model.safetensors.index.json, holding the state dict that
DeepSpeed's zero_to_fp32.py assembles (persistent buffers, frozen parameters, trainable parameters
from their fp32 masters; tied aliases left out, as save_pretrained leaves them out). Tensor-parallel
(AutoTP) and AutoEP checkpoints, which zero_to_fp32.py refuses, are merged by the Universal
Checkpoint rules.

INPUT is the checkpoint's tag folder (e.g. ckpt/global_step100) or the folder holding `latest`;
or a Universal Checkpoint made from one (pyckpt's or ds_to_universal.py's output folder, e.g.
ckpt/global_step100_universal, or the folder holding `latest_universal`), which exports to the same
files. A folder holding both `latest` and `latest_universal` is read through `latest`.
OUTPUT is the folder to create. It appears complete or not at all (written into a hidden sibling
folder and renamed when done); an existing OUTPUT is replaced only with --overwrite. No tensor is
assembled in memory: the bytes go from the memory-mapped input files straight into the
outputs, cast to --dtype on the way. Input files are never unpickled with code execution.

Several processes share the work when started by torchrun, on one node or many:
  torchrun --nproc_per_node K [--nnodes M --rdzv-backend c10d --rdzv-endpoint HOST:PORT] \\
      -m pyckpt.export INPUT OUTPUT --max_shard_size 2GB
Each file is written by one process, which reads only its bytes of the checkpoint: a model that fits
in one model.safetensors goes to one process, so choose --max_shard_size to get several shards.
Files are shared out balanced by bytes, into one hidden folder on a filesystem every node sees that
rank 0 publishes when every process succeeded; the output is the same, bit for bit, as one
process's. A failure on any process publishes nothing and every process exits 1; rank 0 alone
prints (progress, the closing line, --json, --dry-run, the error).
"""

DCP = """\
With --format dcp, OUTPUT is a torch.distributed.checkpoint folder (.metadata and __K_0.distcp data
files) for a job moving to PyTorch FSDP2 or torchtitan, holding what get_state_dict(model,
optimizer) gives there: {"model": the state dict above in --dtype, "optim": {"state": {name:
{step, exp_avg, exp_avg_sq}}, "param_groups": DeepSpeed's groups with their hyper-parameters and
parameter names}}, the Adam moments fp32 from the ZeRO partitions. Load it with
dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=OUTPUT) and set_state_dict, at any
world size. --model-key/--optim-key rename the two entries (--model-key '' puts the model at the top
level, as a model-only DCP checkpoint has it); --no-optimizer writes the model alone. --hf-names
puts AutoEP layers and their optimizer state under the Hugging Face names of the config.json beside
the checkpoint (as the Hugging Face export does), for a job that builds the transformers model.
--torchtitan writes a Hugging Face Llama's state as torchtitan's checkpointer holds it for its own
Llama3 model: the model at the top level under torchtitan's names (q and k rows in its rotary
order), the optimizer flattened under "optimizer" with q, k and v's Adam state as its fused wqkv,
and --initial-lr in every param group. Resume with --checkpoint.initial-load-path OUTPUT
--checkpoint.no-initial-load-model-only --checkpoint.exclude-from-loading
lr_scheduler,dataloader,train_state.
"""
DESCRIPTION += "\n" + DCP

FROM_DCP = """\
INPUT may also be a torch.distributed.checkpoint (DCP) folder, as PyTorch FSDP2's dcp.save and
torchtitan's checkpointer write it (.metadata and __K_0.distcp files; or the sharded safetensors of
torch's HuggingFaceStorageWriter): its model entries are exported as Hugging Face files, each tensor
reassembled from its shards by byte copies (nothing is loaded into memory). --model-key picks the
model (default: "model" where the checkpoint has get_state_dict's {"model", "optim"}, else the
top-level tensors); --config names the model's config.json (or its folder, whose tokenizer files are
copied too), else one beside INPUT is used; a config with tie_word_embeddings leaves lm_head.weight
out, as save_pretrained does. --from-torchtitan maps a torchtitan Llama3 checkpoint back to the
Hugging Face Llama names (q and k rows out of its rotary order); it needs --config.
"""
DESCRIPTION += "\n" + FROM_DCP

EPILOG = """\
zero_to_fp32.py flags are accepted: --max_shard_size, --safe_serialization (the default),
-t/--tag, --exclude_frozen_parameters.

--format dcp: see above; --max_shard_size, --torch-bin and --safe_serialization do not apply.

exit status: 0 done, 1 export failed (one line on stderr; --debug for a traceback), 2 usage.
"""
FORMATTER = argparse.RawDescriptionHelpFormatter
IMPORTS = ("pyckpt.huggingface.export",)  # numpy and the native module: loaded as part of start-up
WRITES_OUTPUT = True


# What zero_to_fp32.py and save_pretrained split at; parsed (to bytes) by the flag's type like a given value.
SHARD_SIZE_DEFAULT = "5GB"
# A chunk of 4 EiB is more than any file holds: beyond it --chunk-mb is a typo, not a size.
CHUNK_MB_MAX = 1 << 42


def add_arguments(p) -> None:
    p.add_argument("input", help="ZeRO checkpoint tag folder, or its parent holding `latest`; or a Universal "
                   "Checkpoint folder, or its parent holding `latest_universal`")
    p.add_argument("output", help="model folder to create")
    p.add_argument("-t", "--tag", default=None,
                   help="the tag folder to export when INPUT holds several (default: the one `latest` or "
                   "`latest_universal` names)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16", "auto"),
                   help="dtype of the floating tensors (integer buffers keep theirs); auto: the dtype of the "
                   "config.json beside the checkpoint, else fp32 (default: fp32, as zero_to_fp32.py)")
    p.add_argument("--max_shard_size", "--max-shard-size", type=shard_size_flag, default=SHARD_SIZE_DEFAULT,
                   help="largest file before the weights are split, as huggingface_hub reads it: 5GB = 5e9 bytes "
                   "(default: 5GB)")
    p.add_argument("--safe_serialization", "--safe-serialization", action="store_true",
                   help="accepted for zero_to_fp32.py compatibility: safetensors is what is written")
    p.add_argument("--torch-bin", "--torch_bin", dest="torch_bin", action="store_true",
                   help="write pytorch_model*.bin (torch.save files; tied aliases kept as shared storage) instead of "
                   "safetensors, as zero_to_fp32.py does without --safe_serialization")
    p.add_argument("--format", default="hf", choices=("hf", "dcp"),
                   help="hf: Hugging Face model files (default); dcp: a torch.distributed.checkpoint folder with the "
                   "optimizer state, for FSDP2 / torchtitan")
    p.add_argument("--model-key", "--model_key", dest="model_key", default=None,
                   help="--format dcp: the top-level key of the model's entries ('' for none; default: model); "
                   "a DCP INPUT: the key its model lies under ('' for the top level; default: auto)")
    p.add_argument("--config", default=None,
                   help="a DCP INPUT: the model's config.json, or its folder (copied with its tokenizer files; "
                   "default: the one beside INPUT)")
    p.add_argument("--from-torchtitan", "--from_torchtitan", dest="from_torchtitan", action="store_true",
                   help="a DCP INPUT saved by torchtitan for its Llama3 model: back to the Hugging Face Llama names "
                   "(needs --config)")
    p.add_argument("--optim-key", "--optim_key", dest="optim_key", default="optim",
                   help="--format dcp: the top-level key of the optimizer state (default: optim)")
    p.add_argument("--no-optimizer", "--no_optimizer", dest="optimizer", action="store_false",
                   help="--format dcp: write the model's entries alone")
    p.add_argument("--hf-names", "--hf_names", dest="hf_names", action="store_true",
                   help="--format dcp: AutoEP routers and experts (and their Adam state) under the Hugging Face names "
                   "of the model type in the config.json beside the checkpoint (Mixtral: gate, "
                   "experts.gate_up_proj, experts.down_proj), as the Hugging Face export writes them")
    p.add_argument("--optim-layout", "--optim_layout", dest="optim_layout", default="nested",
                   choices=("nested", "flat"),
                   help="--format dcp: nested = get_state_dict's optimizer state (default); flat = with "
                   "flatten_optimizer_state_dict=True (param_groups.<name>.<key>), as torchtitan's checkpointer "
                   "keeps it (torchtitan: --model-key '' --optim-key optimizer --optim-layout flat)")
    p.add_argument("--torchtitan", action="store_true",
                   help="--format dcp: a Hugging Face Llama's state as torchtitan's checkpointer holds it for its "
                   "Llama3 model (its names, layout and fused wqkv optimizer state; needs config.json beside the "
                   "checkpoint and --initial-lr)")
    p.add_argument("--initial-lr", "--initial_lr", dest="initial_lr", type=number_flag(low=0), default=None,
                   help="--format dcp: initial_lr of every param group (what torchtitan's LR scheduler starts from; "
                   "its load asks for it)")
    p.add_argument("--chunk-mb", "--chunk_mb", dest="chunk_mb", default=16.0,
                   type=number_flag(low=0, low_open=True, high=CHUNK_MB_MAX),
                   help="--format dcp: tensors are cut along their first dimension into chunks of about this many "
                   "MiB, so that a load at any world size reads little beyond its own rows (default: 16)")
    p.add_argument("--exclude_frozen_parameters", "--exclude-frozen-parameters", action="store_true",
                   help="leave frozen (requires_grad=False) parameters out")
    p.add_argument("--workers", "-j", type=workers_flag, default=None,
                   help="copy threads (default: one per CPU core; under torchrun, the cores divided among the "
                   "node's processes)")
    p.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists (swapped in when complete)")
    p.add_argument("--fsync", action="store_true",
                   help="flush every output file and folder to disk before publishing (survives power loss)")
    p.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                   help="print the files and tensors that would be written, write nothing")
    add_common_flags(p, json="print the report as JSON on stdout", quiet="no progress bar, no closing line")


def run(args) -> int:
    from ..execution.distributed import default_workers
    from ..huggingface.export import export_hf
    from ..inputs.dispatch import DCP, open_checkpoint
    if open_checkpoint(args.input).kind == DCP:
        return _run_from_dcp(args)
    if args.config is not None or args.from_torchtitan:
        raise UsageError("--config and --from-torchtitan are for a DCP INPUT (a folder with .metadata); "
                         f"{args.input} is not one")
    if args.model_key is None:
        args.model_key = "model"
    if args.torch_bin and args.safe_serialization:
        raise UsageError("--torch-bin and --safe_serialization ask for different formats: choose one")
    dcp = args.format == "dcp"
    shard_size_given = args.max_shard_size != shard_size_flag(SHARD_SIZE_DEFAULT)
    if dcp and (args.torch_bin or args.safe_serialization or shard_size_given):
        raise UsageError("--max_shard_size, --torch-bin and --safe_serialization are for Hugging Face files, not "
                         "--format dcp")
    if dcp and args.dtype == "auto":
        raise UsageError("--format dcp takes --dtype fp32, bf16 or fp16")
    if not dcp and (args.model_key != "model" or args.optim_key != "optim" or not args.optimizer or args.hf_names
                    or args.optim_layout != "nested" or args.torchtitan or args.initial_lr is not None):
        raise UsageError("--model-key, --optim-key, --optim-layout, --no-optimizer, --hf-names, --torchtitan and "
                         "--initial-lr are for --format dcp (the Hugging Face export always writes the Hugging Face "
                         "names it knows)")
    from ..dcp.layout import torchtitan_options_problem

    problem = torchtitan_options_problem(args.torchtitan, args.hf_names, args.model_key, args.optim_key,
                                         args.optim_layout, spell=lambda option: "--" + option.replace("_", "-"))
    if problem:
        raise UsageError(problem)
    with cli_common.among_processes() as (ranks, lead):
        workers = args.workers if args.workers is not None or ranks is None else default_workers()
        if dcp:
            from ..dcp.export import export_dcp
            report = export_dcp(args.input, args.output, tag=args.tag, dtype=args.dtype, optimizer=args.optimizer,
                                model_key=args.model_key, optim_key=args.optim_key,
                                chunk_bytes=max(1, int(args.chunk_mb * (1 << 20))),
                                exclude_frozen_parameters=args.exclude_frozen_parameters, hf_names=args.hf_names,
                                optim_layout=args.optim_layout, torchtitan=args.torchtitan,
                                initial_lr=args.initial_lr, overwrite=args.overwrite, dry_run=args.dry_run,
                                workers=workers, progress=lead and not args.quiet, fsync=args.fsync,
                                notify=note if lead and not args.quiet else None, ranks=ranks)
            return report_done(args, report) if lead else 0
        report = export_hf(args.input, args.output, tag=args.tag, dtype=args.dtype,
                           max_shard_size=args.max_shard_size, torch_bin=args.torch_bin,
                           exclude_frozen_parameters=args.exclude_frozen_parameters, overwrite=args.overwrite,
                           dry_run=args.dry_run, workers=workers, progress=lead and not args.quiet,
                           fsync=args.fsync, notify=note if lead and not args.quiet else None, ranks=ranks)
    return report_done(args, report) if lead else 0


def _run_from_dcp(args) -> int:
    from ..execution.distributed import default_workers
    from ..dcp.to_hf import AUTO, export_hf_from_dcp
    if args.format != "hf":
        raise UsageError(f"{args.input} is a DCP checkpoint: it exports to Hugging Face files (--format hf)")
    if (args.tag is not None or args.optim_key != "optim" or not args.optimizer or args.hf_names
            or args.optim_layout != "nested" or args.torchtitan or args.initial_lr is not None
            or args.exclude_frozen_parameters):
        raise UsageError("-t/--tag, --optim-key, --optim-layout, --no-optimizer, --hf-names, --torchtitan, "
                         "--initial-lr and --exclude_frozen_parameters are for a DeepSpeed INPUT, not a DCP one")
    if args.torch_bin and args.safe_serialization:
        raise UsageError("--torch-bin and --safe_serialization ask for different formats: choose one")
    with cli_common.among_processes() as (ranks, lead):
        workers = args.workers if args.workers is not None or ranks is None else default_workers()
        report = export_hf_from_dcp(args.input, args.output, model_key=AUTO if args.model_key is None else
                                    args.model_key, dtype=args.dtype, max_shard_size=args.max_shard_size,
                                    from_torchtitan=args.from_torchtitan, config=args.config,
                                    torch_bin=args.torch_bin, overwrite=args.overwrite, dry_run=args.dry_run,
                                    workers=workers, progress=lead and not args.quiet, fsync=args.fsync,
                                    notify=note if lead and not args.quiet else None, ranks=ranks)
    return report_done(args, report) if lead else 0


def main(argv=None) -> int:
    return cli_common.main(sys.modules[__name__], "python -m pyckpt.export", argv)
