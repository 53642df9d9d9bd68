"""Command line: ``pyckpt convert INPUT OUTPUT`` and ``python -m pyckpt.convert INPUT OUTPUT`` (a drop-in for
ds_to_universal.py).

``python -m pyckpt.convert`` runs :mod:`pyckpt.convert`, which installs the start-up handler and then calls
:func:`main` here.
"""

from __future__ import annotations

import argparse
import sys

from . import common as cli_common
from .common import UsageError, add_common_flags, note, report_done, workers_flag

DESCRIPTION = """\
Convert a DeepSpeed ZeRO (stage 1, 2 or 3) checkpoint to DeepSpeed's Universal Checkpoint layout,
the same files DeepSpeed's ds_to_universal.py writes, so that a run with
{"checkpoint": {"load_universal": true}} can resume it at another data-parallel size.

INPUT is the checkpoint's tag folder (e.g. ckpt/global_step100) or the folder holding `latest`.
OUTPUT is the universal folder to create (e.g. ckpt/global_step100_universal); `latest_universal`
is written beside it, naming it. The output appears complete or not at all: it is written into a
hidden sibling folder and renamed when done. Input files are never unpickled with code execution.

An existing OUTPUT is replaced only with --overwrite, by an atomic swap (OUTPUT always exists, old or
new). Runs into one OUTPUT take turns (a lock file .NAME.pyckpt-lock beside it while one runs). A run
that was killed leaves hidden .NAME.pyckpt-* entries; the next run into OUTPUT removes them, or --clean
does. A signal ignored on entry (SIGHUP under nohup) stays ignored.

INPUT may also be a torch.distributed.checkpoint (DCP) folder of a PyTorch FSDP2 job (dcp.save of
get_state_dict(model, optimizer) with torch Adam or AdamW): the model becomes the fp32 masters and
the Adam state (exp_avg, exp_avg_sq, step) and param groups the optimizer's, so a DeepSpeed job of
the same model, its param groups built in the same order, resumes with load_universal at any world
size and ZeRO stage. --model-key / --optim-key name the entries (default: "model", and "optim" or
torchtitan's "optimizer"). Another optimizer's state (SGD, AMSGrad, Adafactor) is refused.

Several processes share the work when started by torchrun, on one node or many:
  torchrun --nproc_per_node K [--nnodes M --rdzv-backend c10d --rdzv-endpoint HOST:PORT] \\
      -m pyckpt.convert INPUT OUTPUT
Each of the K*M processes writes its share of the output files (balanced by bytes) and reads only
their bytes of the checkpoint, all into one hidden folder that rank 0 publishes when every process
succeeded; INPUT and OUTPUT's parent must be on a filesystem every node sees. The output is the
same, bit for bit, as one process's. A failure on any process publishes nothing and every process
exits 1; rank 0 alone prints (progress, the closing line, --json, --dry-run, the error).
"""

EPILOG = """\
ds_to_universal.py flags are accepted as aliases: --input_folder, --output_folder,
--num_extract_workers / --num_merge_workers (threads here; the larger one is used when --workers is
not given), --inject_missing_state, --no_strict, --keep_temp_folder (no temp folder is ever made).

exit status: 0 done, 1 conversion failed (one line on stderr; --debug for a traceback), 2 usage.
"""
FORMATTER = argparse.RawDescriptionHelpFormatter
IMPORTS = ("pyckpt.universal.convert",)  # numpy and the native module: loaded as part of start-up

# SIGTERM/SIGHUP unwind like Ctrl-C (the staging folder is removed), an interrupt says what was published.
WRITES_OUTPUT = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", nargs="?", help="ZeRO checkpoint tag folder, or its parent holding `latest`")
    p.add_argument("output", nargs="?", help="universal checkpoint folder to create")
    p.add_argument("--input_folder", "--input-folder", dest="input_folder", help="alias of INPUT")
    p.add_argument("--output_folder", "--output-folder", dest="output_folder", help="alias of OUTPUT")
    p.add_argument("--workers", "-j", type=workers_flag, default=None,
                   help="copy threads (default: one per CPU core; under torchrun, the cores divided among the "
                   "node's processes)")
    p.add_argument("--num_extract_workers", type=workers_flag, default=None, help=argparse.SUPPRESS)
    p.add_argument("--num_merge_workers", type=workers_flag, default=None, help=argparse.SUPPRESS)
    p.add_argument("--inject_missing_state", "--inject-missing-state", action="store_true",
                   help="convert checkpoints saved without client_state['universal_checkpoint_info'] "
                   "(as ds_to_universal.py --inject_missing_state; the copied model files are unchanged)")
    p.add_argument("--no_strict", "--no-strict", dest="strict", action="store_false",
                   help="warn instead of failing on unused tensor-parallel merge patterns")
    p.add_argument("--keep_temp_folder", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dense-only", "--dense_only", dest="dense_only", action="store_true",
                   help="for checkpoints with native DeepSpeed-MoE / Megatron-DeepSpeed expert files (no AutoEP "
                   "metadata): convert the dense parameters and leave the experts out, as ds_to_universal.py does "
                   "(without this flag such checkpoints are refused: their experts need a model-specific migration)")
    p.add_argument("--to", default="universal", choices=("universal", ),
                   help="the output format: DeepSpeed's Universal Checkpoint (the only one; for Hugging Face files "
                   "use `pyckpt export`)")
    p.add_argument("--model-key", "--model_key", dest="model_key", default=None,
                   help="a DCP INPUT: the key its model lies under ('' for the top level; default: auto)")
    p.add_argument("--optim-key", "--optim_key", dest="optim_key", default=None,
                   help="a DCP INPUT: the key of its optimizer state (default: optim, or optimizer)")
    p.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists (swapped in when complete)")
    p.add_argument("--clean", action="store_true",
                   help="only clean up: remove what killed runs into OUTPUT left beside it (restoring an old "
                   "OUTPUT a killed swap had set aside), then exit. Give OUTPUT as the only argument")
    p.add_argument("--fsync", action="store_true",
                   help="flush every output file and folder to disk before publishing (survives power loss; "
                        "slower). Without it the output is still complete or absent if the process dies.")
    p.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                   help="print what would be written, write nothing")
    add_common_flags(p, json="print the report as JSON on stdout", quiet="no progress bar, no closing line")


def main(argv=None) -> int:
    return cli_common.main(sys.modules[__name__], "python -m pyckpt.convert", argv)


def run(args) -> int:
    src = args.input_folder or args.input
    dst = args.output_folder or args.output
    if args.clean:
        target = dst or src
        if not target or (src and dst):
            raise UsageError("--clean takes one argument: the OUTPUT folder to clean up beside")
        from .clean import clean_beside
        return clean_beside(target, args)
    if not src or not dst:
        raise UsageError("INPUT and OUTPUT are required (positionally or as --input_folder/--output_folder)")
    workers = args.workers
    if workers is None and (args.num_extract_workers or args.num_merge_workers):
        workers = max(args.num_extract_workers or 0, args.num_merge_workers or 0)
    from ..execution.distributed import default_workers
    from ..universal.convert import convert_to_universal
    from ..inputs.dispatch import DCP, open_checkpoint
    if open_checkpoint(src).kind == DCP:
        if args.inject_missing_state or not args.strict or args.dense_only:
            raise UsageError("--inject_missing_state, --no_strict and --dense-only are for a DeepSpeed INPUT, not a "
                             "DCP one")
        from ..dcp.to_universal import convert_dcp_to_universal
        with cli_common.among_processes() as (ranks, lead):
            if workers is None and ranks is not None:
                workers = default_workers()
            report = convert_dcp_to_universal(src, dst, model_key="auto" if args.model_key is None else args.model_key,
                                              optim_key="auto" if args.optim_key is None else args.optim_key,
                                              overwrite=args.overwrite, dry_run=args.dry_run, workers=workers,
                                              progress=lead and not args.quiet, fsync=args.fsync,
                                              notify=note if lead and not args.quiet else None, ranks=ranks)
        return report_done(args, report) if lead else 0
    if args.model_key is not None or args.optim_key is not None:
        raise UsageError("--model-key and --optim-key are for a DCP INPUT (a folder with .metadata)")
    with cli_common.among_processes() as (ranks, lead):
        if workers is None and ranks is not None:
            workers = default_workers()
        report = convert_to_universal(src, dst, workers=workers, inject_missing_state=args.inject_missing_state,
                                      overwrite=args.overwrite, progress=lead and not args.quiet,
                                      dry_run=args.dry_run, strict=args.strict, dense_only=args.dense_only,
                                      fsync=args.fsync, notify=note if lead and not args.quiet else None, ranks=ranks)
    return report_done(args, report) if lead else 0
