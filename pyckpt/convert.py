"""Command line: ``python -m pyckpt.convert INPUT OUTPUT`` (a drop-in for ds_to_universal.py)."""

from __future__ import annotations

import os
import signal
import sys


def _interrupted_while_starting(signum, frame):
    # Until main() runs, Ctrl-C would surface as a traceback from whichever import it hit.
    print("pyckpt: interrupted while starting; nothing was written", file=sys.stderr)
    os._exit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _interrupted_while_starting)

import argparse  # noqa: E402  (after the start-up handler on purpose)
import json  # noqa: E402

DESCRIPTION = """\
Convert a DeepSpeed ZeRO (stage 1, 2 or 3) checkpoint to DeepSpeed's Universal Checkpoint layout,
the same files DeepSpeed's ds_to_universal.py writes, so that a run with
{"checkpoint": {"load_universal": true}} can resume it at another data-parallel size.

INPUT is the checkpoint's tag folder (e.g. ckpt/global_step100) or the folder holding `latest`.
OUTPUT is the universal folder to create (e.g. ckpt/global_step100_universal); `latest_universal`
is written beside it, naming it. The output appears complete or not at all: it is written into a
hidden sibling folder and renamed when done. Input files are never unpickled with code execution.

An existing OUTPUT is replaced only with --overwrite, by an atomic swap (OUTPUT always exists, old or
new). Runs into one OUTPUT take turns (a lock file .NAME.pyckpt-lock beside it). A run that was
killed leaves hidden .NAME.pyckpt-* entries; the next run into OUTPUT removes them, or --clean does.
"""

EPILOG = """\
ds_to_universal.py flags are accepted as aliases: --input_folder, --output_folder,
--num_extract_workers / --num_merge_workers (threads here; the larger one is used when --workers is
not given), --inject_missing_state, --no_strict, --keep_temp_folder (no temp folder is ever made).

exit status: 0 done, 1 conversion failed (one line on stderr; --debug for a traceback), 2 usage.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pyckpt.convert", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", nargs="?", help="ZeRO checkpoint tag folder, or its parent holding `latest`")
    p.add_argument("output", nargs="?", help="universal checkpoint folder to create")
    p.add_argument("--input_folder", "--input-folder", dest="input_folder", help="alias of INPUT")
    p.add_argument("--output_folder", "--output-folder", dest="output_folder", help="alias of OUTPUT")
    p.add_argument("--workers", "-j", type=int, default=None,
                   help="copy threads (default: one per CPU core)")
    p.add_argument("--num_extract_workers", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--num_merge_workers", type=int, default=None, help=argparse.SUPPRESS)
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
    p.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists (swapped in when complete)")
    p.add_argument("--clean", action="store_true",
                   help="only clean up: remove what killed runs into OUTPUT left beside it (restoring an old "
                   "OUTPUT a killed swap had set aside), then exit. Give OUTPUT as the only argument")
    p.add_argument("--fsync", action="store_true",
                   help="flush every output file and folder to disk before publishing (survives power loss; "
                        "slower). Without it the output is still complete or absent if the process dies.")
    p.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                   help="print what would be written, write nothing")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar, no closing line")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP, raised where Python next runs so that clean-up runs as for Ctrl-C."""


def _terminate(signum, frame):
    raise Terminated(signum)


def main(argv=None) -> int:
    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # from here on, Ctrl-C cleans up
    parser = build_parser()
    args = parser.parse_args(argv)
    previous = {sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return _run(parser, args)
    except KeyboardInterrupt as exc:
        return _interrupted(exc)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _interrupted(exc: KeyboardInterrupt) -> int:
    code = 128 + exc.args[0] if isinstance(exc, Terminated) else 130
    what = "terminated" if isinstance(exc, Terminated) else "interrupted"
    published = getattr(exc, "pyckpt_published", None)
    if published is None:
        print(f"pyckpt: {what}; no output was published", file=sys.stderr)
    elif getattr(exc, "pyckpt_pointer_written", False):
        print(f"pyckpt: {what} after {published} was published and latest_universal updated; a previous output "
              "may be left beside it (the next run or --clean removes it)", file=sys.stderr)
    else:
        print(f"pyckpt: {what} after {published} was published, before latest_universal was updated",
              file=sys.stderr)
    return code


def _run(parser, args) -> int:
    src = args.input_folder or args.input
    dst = args.output_folder or args.output
    if args.clean:
        target = dst or src
        if not target or (src and dst):
            parser.error("--clean takes one argument: the OUTPUT folder to clean up beside")
        return _clean(target, args)
    if not src or not dst:
        parser.error("INPUT and OUTPUT are required (positionally or as --input_folder/--output_folder)")
    workers = args.workers
    if workers is None and (args.num_extract_workers or args.num_merge_workers):
        workers = max(args.num_extract_workers or 0, args.num_merge_workers or 0)
    try:
        from .universal import convert_to_universal
        report = convert_to_universal(src, dst, workers, inject_missing_state=args.inject_missing_state,
                                      overwrite=args.overwrite, progress=not args.quiet, dry_run=args.dry_run,
                                      strict=args.strict, dense_only=args.dense_only, fsync=args.fsync,
                                      notify=None if args.quiet else _note)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # one clear line, the traceback only on request
        if args.debug:
            raise
        print(f"pyckpt: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    if args.dry_run:
        print(report.plan_text)
        return 0
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    if not args.quiet:
        print(f"pyckpt: {report.summary()}", file=sys.stderr)
    return 0


def _clean(target: str, args) -> int:
    try:
        from .execution.publish import clean
        done = clean(target, notify=_note)
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        if args.debug:
            raise
        print(f"pyckpt: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"output": target, "removed": done}, indent=2))
    elif not args.quiet:
        for name in done:
            print(f"pyckpt: cleaned {name}", file=sys.stderr)
        print(f"pyckpt: nothing left behind by earlier runs into {target}" if not done else
              f"pyckpt: cleaned {len(done)} entr{'y' if len(done) == 1 else 'ies'} beside {target}", file=sys.stderr)
    return 0


def _note(text: str) -> None:
    print(f"pyckpt: {text}", file=sys.stderr)


def _one_line(exc: BaseException) -> str:
    """The message on one line whatever it holds (a name with a newline must not split it)."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, KeyError) and exc.args:
        text = f"missing key {exc.args[0]!r}"
    return " ".join(text.split("\n")) if "\n" in text else text


if __name__ == "__main__":
    sys.exit(main())
