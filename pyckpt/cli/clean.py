"""Command line: ``pyckpt clean OUTPUT``, the same as ``python -m pyckpt.convert --clean OUTPUT``."""

import argparse
import json
import sys

from .common import UsageError, add_common_flags, note

DESCRIPTION = """\
Remove what killed runs into OUTPUT left beside it (the hidden .NAME.pyckpt-* entries), restoring
an old OUTPUT that a killed swap had set aside, then exit. Every conversion into OUTPUT does this
first anyway. A run into OUTPUT that is still going is waited for (it holds .NAME.pyckpt-lock).

With --memory JOB instead: remove job JOB's memory tier on this node (its checkpoints in node-local
memory, <root>/JOB; root: --memory-root, else $PYCKPT_MEMORY_ROOT, else /dev/shm/pyckpt-<uid>). A job
that named no id of its own keeps them in a folder named after its save dir (default-<hex>, or none-<hex>
under torchrun without --rdzv-id), which its first memory save logs: give that name.
Links inside are removed, never followed; a root that is a link, another user's or writable by
others is refused. Persist what you need first: the memory tier is not durable storage.
"""
EPILOG = """\
exit status: 0 done, 1 failed (one line on stderr; --debug for a traceback), 2 usage.
"""
FORMATTER = argparse.RawDescriptionHelpFormatter
IMPORTS = ("pyckpt.execution.publish",)  # numpy and the native module: loaded as part of start-up
# As for a conversion: SIGTERM/SIGHUP unwind like Ctrl-C, and an interrupt says nothing was published.
WRITES_OUTPUT = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("output", nargs="?", help="the universal checkpoint folder the killed runs were writing")
    p.add_argument("--memory", metavar="JOB", default=None,
                   help="remove job JOB's memory-tier folder on this node instead (see above)")
    p.add_argument("--memory-root", metavar="ROOT", default=None,
                   help="the memory root (default: $PYCKPT_MEMORY_ROOT, else /dev/shm/pyckpt-<uid>)")
    add_common_flags(p, json="print what was removed as JSON on stdout", quiet="print nothing but errors")


def run(args) -> int:
    if args.memory is not None:
        if args.output is not None:
            raise UsageError("give OUTPUT or --memory JOB, not both")
        return clean_memory(args)
    if args.output is None:
        raise UsageError("OUTPUT is required (or --memory JOB)")
    return clean_beside(args.output, args)


def clean_memory(args) -> int:
    import os

    from ..deepspeed.tiers.job_identity import job_id
    from ..deepspeed.tiers.memory_root import default_root, open_root, remove_job
    from ..errors import printable

    job = job_id(args.memory)
    root = args.memory_root or default_root()
    try:
        root = open_root(root, create=False)
    except FileNotFoundError:
        done = []
    else:
        done = remove_job(root, job)
    where = os.path.join(root, job)
    if args.json:
        print(json.dumps({"memory": where, "removed": done}, indent=2))
    elif not args.quiet:
        print(f"pyckpt: no memory tier of job {printable(job)} in {printable(root)}" if not done else
              f"pyckpt: removed job {printable(job)}'s memory tier {printable(where)} ({len(done)} entries)",
              file=sys.stderr)
    return 0


def clean_beside(target: str, args) -> int:
    from ..errors import printable
    from ..execution.leftovers import clean
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
