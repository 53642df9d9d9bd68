"""The ``pyckpt`` console script (and ``python -m pyckpt``): one command with subcommands.

``pyckpt NAME ...`` is ``python -m pyckpt.NAME ...`` (same flags, output and exit status; ``inspect``
is ``pyckpt.describe``, ``clean`` is ``convert --clean``); each subcommand is a module of this folder
named after it (``pyckpt.cli.NAME``), a command as :mod:`pyckpt.cli.common` describes, and
``pyckpt/NAME.py`` only forwards ``python -m`` to it. Only the chosen subcommand's module is imported,
and those modules load numpy and the native reader only once they run, so that parsing (and
--help) starts fast and a Ctrl-C during start-up is one line, as for ``python -m pyckpt.convert``.

Import rule: the front ends' floor (with the ``python -m`` entry points beside it, which import only
from here); a subcommand's module is imported by name when chosen, and the library never imports this
folder.
"""

import sys

from . import common as cli_common

# name (its module is pyckpt.cli.NAME), the line `pyckpt --help` shows. A new subcommand is one row here.
COMMANDS = (
    ("convert", "convert a ZeRO checkpoint to DeepSpeed's Universal Checkpoint layout"),
    ("export", "export as Hugging Face safetensors (zero_to_fp32) or torch DCP (with the optimizer)"),
    ("inspect", "show a ZeRO checkpoint's stage, dp degree, dtypes, parameters and files"),
    ("verify", "check a Universal Checkpoint folder before deleting the checkpoint it came from"),
    ("clean", "remove what killed conversions into OUTPUT left beside it, or a job's memory tier"),
)

DESCRIPTION = """\
Fast, safe conversion of DeepSpeed ZeRO checkpoints. Each command is also `python -m
pyckpt.NAME` (`pyckpt inspect` is `python -m pyckpt.describe`; `pyckpt clean OUTPUT` is
`python -m pyckpt.convert --clean OUTPUT`).
"""
EPILOG = "`pyckpt COMMAND --help` shows a command's options."


def parse(argv, prog: str = "pyckpt"):
    """(command module, its parser, parsed args); argparse exits on --help and usage errors."""
    import argparse
    import importlib
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(title="commands", dest="pyckpt_command", metavar="COMMAND", required=True)
    # The top level has no options but --help, so the first word that is not a flag names the command.
    word = next((a for a in argv if not a.startswith("-")), None)
    chosen = {}
    for name, summary in COMMANDS:
        if name != word:
            sub.add_parser(name, help=summary)  # listed, never parsed with: its module stays unloaded
            continue
        command = importlib.import_module(f"{__name__}.{name}")
        chosen[name] = command, sub.add_parser(name, help=summary, **cli_common.parser_options(command))
        command.add_arguments(chosen[name][1])
    args = parser.parse_args(argv)
    command, subparser = chosen[args.pyckpt_command]
    return command, subparser, args


def main(argv=None, prog: str = "pyckpt") -> int:
    if argv is None:  # a program starting (not a caller in-process): Ctrl-C until the command runs is one line
        cli_common.starting()
        argv = sys.argv[1:]
    command, parser, args = parse(list(argv), prog)
    return cli_common.execute(command, parser, args)
