"""Command line: ``python -m pyckpt.inspect CKPT`` and ``pyckpt inspect CKPT``.

Apart from inspect.py so that the pyckpt console script can parse its arguments without loading
the reader (and numpy) that describe() needs.
"""

import json
import sys

from . import cli_common
from .cli_common import add_common_flags

DESCRIPTION = ("Show a DeepSpeed ZeRO checkpoint's stage, dp degree, dtypes, parameter count, bytes and files. "
               "Reads only the pickled metadata; runs no code from it.")
IMPORTS = ("pyckpt.inspect",)  # numpy and the native module: loaded as part of start-up


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="tag folder, or the folder holding `latest`")
    add_common_flags(p, json="machine-readable output")


def run(args) -> int:
    from .inspect import describe
    info = describe(args.checkpoint)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    for key, value in info.items():
        if key == "file_sizes":
            print("files:")
            for name, size in value.items():
                print(f"  {size:>14,d}  {name}")
        else:
            print(f"{key}: {value}")
    return 0


def main(argv=None) -> int:
    return cli_common.main(sys.modules[__name__], "python -m pyckpt.inspect", argv)
