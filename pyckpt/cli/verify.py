"""Command line: ``python -m pyckpt.verify OUTPUT [--against INPUT]`` and ``pyckpt verify ...``.

The checks are :mod:`pyckpt.universal.verify`, imported only when the command runs, so that the
pyckpt console script parses its arguments without loading the reader (and numpy).
"""

import argparse
import json
import sys

from . import common as cli_common
from .common import add_common_flags

DESCRIPTION = """\
Check that a Universal Checkpoint folder is complete and well-formed, before deleting the ZeRO
checkpoint it was converted from. Run it on the output of `python -m pyckpt.convert` or of
DeepSpeed's ds_to_universal.py. Nothing is unpickled with code execution.

OUTPUT is the universal folder (e.g. ckpt/global_step100_universal) or the folder holding
`latest_universal` (the pointer is followed and must name an existing folder).

Checked:
  * every .pt file parses (pyckpt's safe reader) and every ZIP member matches its CRC-32;
  * the model-state files DeepSpeed resumes from are all there (one per model-parallel rank,
    ZeRO-3: per dp rank) and parse; zero/optimizer_state.pt exists;
  * each parameter folder zero/<name> has a valid name, fp32.pt and the optimizer-state files the
    other parameters have (exp_avg, exp_avg_sq, step), float32, equal shapes, the dict layout and
    markers load_universal reads (param, cat_dim, vocab_tensor, is_expert_param, ep_num_experts);
  * the parameter folders are exactly the parameters the model states name (param_shapes; ZeRO-1/2
    also module entries, which are written as fp32.pt only), with shapes that agree with
    param_shapes (tensor-parallel slices merged, AutoEP experts gathered);
  * with --against INPUT: the conversion of INPUT is planned again (nothing written) and every
    planned file must exist with the planned tensors' dtypes, shapes and byte counts and no other
    file; tensor bytes are compared by CRC-32 with the input's (--no-content to skip this).

OUTPUT may also be a torch.distributed.checkpoint folder, given alone: the metadata parses by the
allowlist reader and follows DCP's rules (data files inside the folder, records inside their files
and apart, chunks tiling their tensors), every record's archive opens in its byte range with each
member matching its CRC-32, every chunk's tensor is of its entry's dtype and the chunk's sizes, and
every value's pickle parses; for torch's safetensors-backed layout, the headers and that every
tensor's bytes lie inside its file.

OUTPUT may also be a torch.distributed.checkpoint folder made by `pyckpt export --format dcp`,
checked --against the checkpoint it was exported from: the export is planned again with the options
it recorded (.pyckpt-export.json); the .metadata must be the planned one byte for byte (every entry,
chunk and location), the data files their planned sizes, every chunk's archive where the metadata
says with the planned members and pickle, each member matching its CRC-32, and each chunk's bytes
the input's (CRC-32).
"""

EPILOG = """\
exit status: 0 all checks passed, 1 problems found (one line each: the file, what is wrong),
2 usage error, or OUTPUT/INPUT cannot be read as a checkpoint at all.
"""
FORMATTER = argparse.RawDescriptionHelpFormatter
# numpy and the native module: loaded as part of start-up
IMPORTS = ("pyckpt.universal.verify", "pyckpt.dcp.check")
# An OUTPUT or INPUT that cannot be read at all is told apart from one with problems (exit 1).
ERROR_EXIT = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("output", help="universal checkpoint folder, or its parent holding latest_universal")
    p.add_argument("--against", metavar="INPUT", help="the ZeRO checkpoint (tag folder or its parent holding "
                   "`latest`) OUTPUT was converted from: compare OUTPUT with pyckpt's plan for it")
    p.add_argument("--no-content", dest="content", action="store_false",
                   help="with --against, compare names, shapes and sizes only, not tensor bytes")
    p.add_argument("--dense-only", "--dense_only", dest="dense_only", action="store_true",
                   help="with --against: OUTPUT was converted with --dense-only")
    add_common_flags(p, json="print the report as JSON on stdout", quiet="no progress, only the summary line")


def run(args) -> int:
    from ..inputs.dispatch import DCP, open_checkpoint
    from ..universal.verify import verify_universal
    if open_checkpoint(args.output).kind == DCP:
        if not args.against:  # any DCP folder, checked on its own
            from ..dcp.check import check_dcp
            return _print(args, check_dcp(args.output))
        # only pyckpt's own export can be planned again; verify_dcp refuses any other, naming the rule
        from ..dcp.verify import verify_dcp
        return _print(args, verify_dcp(args.output, against=args.against, content=args.content))
    # The byte counter draws only on a terminal; elsewhere making one would only cost a walk of the
    # folder and a tqdm whose half-made instance prints a traceback if a Ctrl-C lands in its making.
    progress = not args.quiet and not args.json and getattr(sys.stderr, "isatty", lambda: False)()
    report = verify_universal(args.output, against=args.against, dense_only=args.dense_only, content=args.content,
                              progress=progress)
    return _print(args, report)


def _print(args, report) -> int:
    from ..errors import bounded_line, printable_line
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))  # escapes every control character itself
    else:
        for p in report.problems:  # a path found in the folder may hold any character but / and NUL
            print(bounded_line(printable_line(str(p))))
        print(printable_line(report.summary()))
    return 0 if report.ok else 1


def main(argv=None) -> int:
    return cli_common.main(sys.modules[__name__], "python -m pyckpt.verify", argv)
