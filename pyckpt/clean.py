"""Command line: ``pyckpt clean OUTPUT``, the same as ``python -m pyckpt.convert --clean OUTPUT``."""

import argparse
import json
import sys

from .cli.common import add_common_flags, note

DESCRIPTION = """\
Remove what killed runs into OUTPUT left beside it (the hidden .NAME.pyckpt-* entries), restoring
an old OUTPUT that a killed swap had set aside, then exit. Every conversion into OUTPUT does this
first anyway. A run into OUTPUT that is still going is waited for (it holds .NAME.pyckpt-lock).
"""
EPILOG = """\
exit status: 0 done, 1 failed (one line on stderr; --debug for a traceback), 2 usage.
"""
FORMATTER = argparse.RawDescriptionHelpFormatter
IMPORTS = ("pyckpt.execution.publish",)  # numpy and the native module: loaded as part of start-up
# As for a conversion: SIGTERM/SIGHUP unwind like Ctrl-C, and an interrupt says nothing was published.
WRITES_OUTPUT = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("output", help="the universal checkpoint folder the killed runs were writing")
    add_common_flags(p, json="print what was removed as JSON on stdout", quiet="print nothing but errors")


def run(args) -> int:
    return clean_beside(args.output, args)


def clean_beside(target: str, args) -> int:
    from .errors import printable
    from .execution.publish import clean
    done = clean(target, notify=note)
    if args.json:
        print(json.dumps({"output": target, "removed": done}, indent=2))
    elif not args.quiet:
        for name in done:  # names found beside OUTPUT: shown escaped, as any name from a listing
            print(f"pyckpt: cleaned {printable(name)}", file=sys.stderr)
        print(f"pyckpt: nothing left behind by earlier runs into {printable(target)}" if not done else
              f"pyckpt: cleaned {len(done)} entr{'y' if len(done) == 1 else 'ies'} beside {printable(target)}",
              file=sys.stderr)
    return 0
