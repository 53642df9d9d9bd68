"""Command line: ``pyckpt inspect CKPT`` and ``python -m pyckpt.describe CKPT``.

Named after the subcommand users type: inside this package the name cannot shadow the standard library's
``inspect`` (imports are absolute). The ``python -m`` entry point keeps its documented name,
:mod:`pyckpt.describe`.
"""

import json
import sys

from . import common as cli_common
from .common import add_common_flags

DESCRIPTION = ("Show a DeepSpeed ZeRO checkpoint's stage, dp degree, dtypes, parameter count, bytes and files; "
               "or a torch.distributed.checkpoint folder's layout, data files, top-level keys, model, optimizer "
               "state and values. Reads only the pickled metadata; runs no code from it.")
# numpy and the native module: loaded as part of start-up
IMPORTS = ("pyckpt.zero.describe", "pyckpt.dcp.describe")


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="tag folder, or the folder holding `latest`, or a torch.distributed.checkpoint "
                   "folder")
    add_common_flags(p, json="machine-readable output")


def run(args) -> int:
    from ..errors import bounded_line, clipped, printable, printable_line
    from ..inputs.dispatch import DCP, open_checkpoint
    if open_checkpoint(args.checkpoint).kind == DCP:
        from ..dcp.describe import describe_dcp
        info = describe_dcp(args.checkpoint)
        if args.json:
            print(json.dumps(info, indent=2, default=str))
        else:
            _print_dcp(info)
        return 0
    from ..zero.describe import describe
    info = describe(args.checkpoint)
    if args.json:
        print(json.dumps(info, indent=2, default=str))  # escapes every control character itself
        return 0
    # The values come from the checkpoint (ds_version, the tag `latest` names, file names): a string is
    # shown escaped, so that none can forge a line of this output or drive the terminal, and cut, so that
    # none fills it.
    for key, value in info.items():
        if key == "file_sizes":
            print("files:")
            for name, size in value.items():
                print(f"  {size:>14,d}  {printable(name)}")
        elif key == "resumable_at":
            print(f"resumable at: {bounded_line(printable_line(value))}")
        elif key != "resumable":  # the same in words above
            shown = clipped(printable(value)) if isinstance(value, str) else bounded_line(printable_line(str(value)))
            print(f"{key}: {shown}")
    return 0


def _print_dcp(info: dict) -> None:
    """A DCP folder's description, one fact a line; every key and value from the checkpoint escaped and cut."""
    from ..errors import clipped, printable_line

    def shown(value) -> str:
        return clipped(printable_line(value if isinstance(value, str) else str(value)), 500)

    def counts(d: dict) -> str:
        return ", ".join(f"{shown(k)} {v}" for k, v in d.items()) or "none"

    print(f"folder: {shown(info['folder'])}")
    print(f"format: {info['format']} ({info['layout']} layout)")
    print(f"entries: {info['entries']} ({info['tensors']} tensors of {info['numel']:,d} elements, "
          f"{info['values']} values)")
    print(f"dtypes: {counts(info['dtypes'])}")
    print("top-level keys:")
    for key, row in info["top_level"].items():
        print(f"  {shown(key)}: {row['tensors']} tensors ({row['numel']:,d} elements), {row['values']} values")
    model = info["model"]
    if model is None:
        print("model: none found")
    else:
        where = f"under {shown(repr(model['key']))}" if model["key"] else "at the top level"
        print(f"model: {model['tensors']} tensors {where}, {model['parameters']:,d} parameters, "
              f"dtypes {counts(model['dtypes'])}")
    optim = info["optimizer"]
    if optim is None:
        print("optimizer state: none")
    else:
        groups = f", {optim['param_groups']} param groups" if optim["param_groups"] is not None else ""
        print(f"optimizer state: under {shown(repr(optim['key']))} ({optim['layout']}), {optim['params']} parameters"
              f"{groups}; per state: {counts(optim['states'])}; dtypes {counts(optim['state_dtypes'])}")
    values = info["value_entries"]
    if values:
        more = info["values"] - len(values)
        print("values:" + (f" (first {len(values)}; {more} more)" if more else ""))
        for key, value in values.items():
            if "value" in value:
                print(f"  {shown(key)} = {shown(repr(value['value']))}")
            else:
                items = f" of {value['items']} items" if value["items"] is not None else ""
                print(f"  {shown(key)}: a {shown(value['type'])}{items}")
    print("files:")
    for name, size in info["file_sizes"].items():
        print(f"  {size:>14,d}  {shown(name)}")
    print(f"files: {info['files']}, bytes: {info['bytes']:,d}")


def main(argv=None) -> int:
    return cli_common.main(sys.modules[__name__], "python -m pyckpt.describe", argv)
