"""What pyckpt's command lines share: the common flags, one-line errors, Ctrl-C and SIGTERM.

A command is a module of this folder, ``pyckpt.cli.<name>``, with ``DESCRIPTION`` (and optionally
``EPILOG``, ``FORMATTER``), ``add_arguments(parser)`` and ``run(args) -> int``. ``run`` raises on
failure (``UsageError`` for a usage mistake, anything else becomes ``pyckpt: error: <one line>``).
Optional module attributes: ``IMPORTS`` (the modules ``run`` needs, loaded while a Ctrl-C still
counts as start-up), ``ERROR_EXIT`` (the exit status of such an error, 1) and ``WRITES_OUTPUT``
(True: SIGTERM/SIGHUP unwind like Ctrl-C so that clean-up runs, and an interrupt says what was
published). A signal ignored on entry (SIGHUP under nohup, SIGINT in a background job) is left
ignored. The same module serves ``python -m pyckpt.<name>`` (``pyckpt/<name>.py``, ``describe.py``
for inspect, forwards to the command's ``main``, which calls :func:`main` here) and ``pyckpt
<name>`` (:mod:`pyckpt.cli`).

Only os, signal and sys are imported at the top: the ``python -m`` entry points import this module
before their start-up handler is in place, and the console script before parsing its arguments.
"""

import os
import signal
import sys


class UsageError(Exception):
    """A usage mistake argparse cannot see (flags that exclude each other): exit 2 with the usage."""


class ReportedElsewhere(Exception):
    """A failure another process of the same run reports (rank 0 of a torchrun launch prints the
    message every rank raised): exit 1 without repeating the line."""


class Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP, raised where Python next runs so that clean-up runs as for Ctrl-C."""


def _terminate(signum, frame):
    raise Terminated(signum)


# -- start-up ----------------------------------------------------------------------------------

def interrupted_while_starting(signum, frame):
    # Until a command runs, Ctrl-C would surface as a traceback from whichever import it hit.
    print("pyckpt: interrupted while starting; nothing was written", file=sys.stderr)
    os._exit(128 + signum)


def starting() -> None:
    """Ctrl-C from here until :func:`started` exits with one line (a program's own start-up only:
    a handler someone else installed is left alone, and so is SIGINT ignored on entry, which Python
    leaves ignored)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        try:
            signal.signal(signal.SIGINT, interrupted_while_starting)
        except ValueError:
            pass  # not the main thread: signals are not ours to handle


def started() -> None:
    """From here on, Ctrl-C raises KeyboardInterrupt, so that a command cleans up after itself."""
    if signal.getsignal(signal.SIGINT) is interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# -- parsers -----------------------------------------------------------------------------------

def parser_options(command) -> dict:
    """ArgumentParser keywords from a command module (the same for ``python -m`` and a subcommand)."""
    options = {"description": command.DESCRIPTION, "epilog": getattr(command, "EPILOG", None)}
    if getattr(command, "FORMATTER", None) is not None:
        options["formatter_class"] = command.FORMATTER
    return options


def add_common_flags(parser, json: str, quiet: str = None) -> None:
    """--json, --quiet/-q (where a command has something to silence) and --debug, last in --help."""
    parser.add_argument("--json", action="store_true", help=json)
    if quiet:
        parser.add_argument("--quiet", "-q", action="store_true", help=quiet)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


def number_flag(*, integer: bool = False, low=None, high=None, low_open: bool = False):
    """An argparse ``type`` taking what :func:`pyckpt.errors.check_number` takes (finite, in range):
    anything else (inf, nan, a negative count, 1e999) is a usage error naming the flag (exit 2)."""
    import argparse

    def parse(text: str):
        from ..errors import check_number, number_rule
        rule = number_rule(integer, low, high, low_open)
        try:
            return check_number("", int(text) if integer else float(text), integer=integer, low=low, high=high,
                                low_open=low_open)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {rule}, not {text!r}") from None
    parse.__name__ = "integer" if integer else "number"
    return parse


def shard_size_flag(text: str) -> int:
    """The ``type`` of --max_shard_size: bytes, as huggingface_hub reads a size ("5GB" is 5e9 bytes, as
    :func:`pyckpt.huggingface.shards.parse_size` says); anything else is a usage error naming the flag
    (exit 2), made once, however the command goes on to use it."""
    import argparse

    from ..huggingface.shards import parse_size
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def workers_flag(text: str) -> int:
    """The ``type`` of --workers/-j: 0 (one per core) up to pyckpt.errors.WORKERS_MAX."""
    from ..errors import WORKERS_MAX
    return number_flag(integer=True, low=0, high=WORKERS_MAX)(text)


def build_parser(command, prog: str):
    import argparse
    parser = argparse.ArgumentParser(prog=prog, **parser_options(command))
    command.add_arguments(parser)
    return parser


def main(command, prog: str, argv=None) -> int:
    """``python -m pyckpt.<name>``: parse ``argv`` and :func:`execute` the command."""
    parser = build_parser(command, prog)
    return execute(command, parser, parser.parse_args(argv))


# -- running -----------------------------------------------------------------------------------

def execute(command, parser, args) -> int:
    """Run a parsed command; the one place that turns exceptions into messages and exit statuses."""
    writes = getattr(command, "WRITES_OUTPUT", False)
    # A signal ignored on entry stays ignored: that is how nohup (SIGHUP) and a shell's background
    # job (SIGINT) ask a program to outlive the terminal.
    caught = [s for s in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) is not signal.SIG_IGN] if writes else []
    previous = {sig: signal.signal(sig, _terminate) for sig in caught}
    import warnings  # loaded by Python itself at start-up
    formatwarning = warnings.formatwarning
    warnings.formatwarning = _escaped_warnings(formatwarning)
    try:
        # Under the start-up handler: numpy turns a KeyboardInterrupt inside its import into an
        # ImportError, which would be reported as a broken installation.
        for name in getattr(command, "IMPORTS", ()):
            __import__(name)
        started()
        return command.run(args)
    except KeyboardInterrupt as exc:
        return interrupted(exc, writes)
    except UsageError as exc:
        parser.error(str(exc))
    except ReportedElsewhere:
        return getattr(command, "ERROR_EXIT", 1)
    except Exception as exc:  # one clear line, the traceback only on request
        if args.debug:
            raise
        print(f"pyckpt: error: {one_line(exc)}", file=sys.stderr)
        return getattr(command, "ERROR_EXIT", 1)
    finally:
        warnings.formatwarning = formatwarning
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _escaped_warnings(formatwarning):
    """A warning's text may hold names from the checkpoint: shown escaped and bounded as an error would be."""
    def escaped(message, category, filename, lineno, line=None):
        from ..errors import bounded_line, printable_line
        return formatwarning(bounded_line(printable_line(str(message))), category, filename, lineno, line)
    return escaped


def interrupted(exc: KeyboardInterrupt, writes: bool) -> int:
    code = 128 + exc.args[0] if isinstance(exc, Terminated) else 130
    what = "terminated" if isinstance(exc, Terminated) else "interrupted"
    # The publisher marks the exception with how far it got, so the user knows what is on disk.
    published = getattr(exc, "pyckpt_published", None)
    if not writes:
        print(f"pyckpt: {what}", file=sys.stderr)
    elif published is None:
        print(f"pyckpt: {what}; no output was published", file=sys.stderr)
    elif getattr(exc, "pyckpt_pointer", "") is None:  # an output without a pointer file
        print(f"pyckpt: {what} after {published} was published; a previous output may be left beside it (the "
              "next run removes it)", file=sys.stderr)
    elif getattr(exc, "pyckpt_pointer_written", False):
        print(f"pyckpt: {what} after {published} was published and latest_universal updated; a previous output "
              "may be left beside it (the next run or --clean removes it)", file=sys.stderr)
    else:
        print(f"pyckpt: {what} after {published} was published, before latest_universal was updated",
              file=sys.stderr)
    return code


def report_done(args, report) -> int:
    """What a command that writes an output prints at the end: the plan of a dry run, the report as
    JSON on request, and a closing line on stderr unless quiet."""
    from ..errors import printable_line
    if args.dry_run:
        # Line by line: the plan's own lines stay lines, and what a name left in them cannot drive the terminal.
        print("\n".join(printable_line(line) for line in report.plan_text.split("\n")))
        return 0
    if args.json:
        import json
        print(json.dumps(report.to_dict(), indent=2))  # escapes every control character itself
    if not args.quiet:
        print(f"pyckpt: {printable_line(report.summary())}", file=sys.stderr)
    return 0


def among_processes():
    """A context for a command that writes an output, giving (ranks, lead): the torch.distributed
    processes it runs among (None for a single process) and whether this one speaks for the run
    (rank 0), which alone shows progress, notes, the closing line and a failure every rank shares.
    On the other ranks such a shared failure becomes ReportedElsewhere (exit 1, no second line); a
    process group made for the run is taken down on the way out."""
    import contextlib

    from ..errors import RanksFailedError
    from ..execution.distributed import from_launcher

    @contextlib.contextmanager
    def context():
        ranks = from_launcher()
        lead = ranks is None or ranks.rank == 0
        try:
            yield ranks, lead
        except RanksFailedError:
            if lead:
                raise
            raise ReportedElsewhere() from None
        finally:
            if ranks is not None:
                ranks.close()
    return context()


def note(text: str) -> None:
    from ..errors import bounded_line, printable_line
    print(f"pyckpt: {bounded_line(printable_line(text))}", file=sys.stderr)


def one_line(exc: BaseException) -> str:
    """The message on one line whatever it holds: a name with a newline must not split it, a control
    character in it drive the terminal, nor a megabyte of it fill the screen (pyckpt's own errors are
    escaped and bounded when made; this is for everyone else's)."""
    from ..errors import bounded_line, printable_line, quoted
    text = str(exc) or type(exc).__name__
    if isinstance(exc, KeyError) and exc.args:
        text = f"missing key {quoted(exc.args[0])}"
    return bounded_line(printable_line(" ".join(text.split("\n")) if "\n" in text else text))
