"""Command line: ``pyckpt inspect CKPT`` and ``python -m pyckpt.describe CKPT``.

Named after the subcommand users type: inside this package the name cannot shadow the standard library's
``inspect`` (imports are absolute). The ``python -m`` entry point keeps its documented name,
:mod:`pyckpt.describe`.
"""

import json
import sys

from . import common as cli_common
from .common import add_common_flags

DESCRIPTION = ("Show a DeepSpeed ZeRO checkpoint's stage, dp degree, dtypes, parameter count, bytes and files. "
               "Reads only the pickled metadata; runs no code from it.")
IMPORTS = ("pyckpt.zero.describe",)  # numpy and the native module: loaded as part of start-up


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="tag folder, or the folder holding `latest`")
    add_common_flags(p, json="machine-readable output")


def run(args) -> int:
    from ..errors import printable, printable_line
    from ..zero.describe import describe
    info = describe(args.checkpoint)
    if args.json:
        print(json.dumps(info, indent=2, default=str))  # escapes every control character itself
        return 0
    # The values come from the checkpoint (ds_version, the tag `latest` names, file names): a string is
    # shown escaped, so that none can forge a line of this output or drive the terminal.
    for key, value in info.items():
        if key == "file_sizes":
            print("files:")
            for name, size in value.items():
                print(f"  {size:>14,d}  {printable(name)}")
        elif key == "resumable_at":
            print(f"resumable at: {printable_line(value)}")
        elif key != "resumable":  # the same in words above
            print(f"{key}: {printable(value) if isinstance(value, str) else printable_line(str(value))}")
    return 0


def main(argv=None) -> int:
    return cli_common.main(sys.modules[__name__], "python -m pyckpt.describe", argv)
