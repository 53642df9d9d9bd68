"""The exceptions pyckpt raises on purpose, and the one rule that turns a stray lookup failure into one.

Every error about input names the file and the rule it broke, so a user can act on one line.
"""

import contextlib
import math
import numbers
import os
import re


# -- text from a checkpoint --------------------------------------------------------------------

# Candidates only (anything but printable ASCII); str.isprintable decides, as repr does.
_UNUSUAL = re.compile(r"[^\x20-\x7e]|\\")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def _escape(c: str, backslash: bool) -> str:
    if c == "\\":
        return "\\\\" if backslash else c
    if c.isprintable():
        return c
    if c in _NAMED:
        return _NAMED[c]
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text) -> str:
    """``text`` (a name, a version, a file name read from a checkpoint) as it may be shown: what
    ``str.isprintable`` refuses (C0 and C1 controls, line and paragraph separators, bidirectional
    overrides and other format characters, lone surrogates) and the backslash are written as repr
    writes them (``\\x1b``, ``\\n``, ``\\u202e``, ``\\\\``), so it cannot move the cursor, clear the
    screen, start a line of its own or reorder what follows; printable text is left as it is."""
    text = text if isinstance(text, str) else str(text)
    return _UNUSUAL.sub(lambda m: _escape(m.group(), True), text) if _UNUSUAL.search(text) else text


def printable_line(text: str) -> str:
    """A message as one line: :func:`printable`'s escapes, except that a backslash stays as it is, so
    that a message whose values were escaped already (``{name!r}``, :func:`printable`) reads the same."""
    return _UNUSUAL.sub(lambda m: _escape(m.group(), False), text) if _UNUSUAL.search(text) else text


# What a message quotes of an input (a name, a value): a checkpoint's string may be a megabyte long.
QUOTE_MAX = 200
# A whole message line, whatever its parts quote: past this, its middle is cut.
LINE_MAX = 4000


def clipped(text: str, limit: int = QUOTE_MAX) -> str:
    """``text`` as a message may quote it: at most ``limit`` characters, then its whole length
    (``...(1,000,189 characters)``)."""
    text = text if isinstance(text, str) else str(text)
    return text if len(text) <= limit else f"{text[:limit]}...({len(text):,} characters)"


def quoted(value, limit: int = QUOTE_MAX) -> str:
    """``repr(value)`` as a message may quote it (:func:`clipped`): the one way a message shows what an
    input holds. A long string is cut before its repr is made; a value whose repr fails (an integer of
    thousands of digits, a structure nested past the recursion limit) is named by its type."""
    if isinstance(value, str) and len(value) > limit:
        return f"{repr(value[:limit])[:limit]}...({len(value):,} characters)"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 600:
        return f"an integer of {value.bit_length():,} bits"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 -- ValueError (int digits), RecursionError, a record's own failure
        return f"a {type(value).__name__} that cannot be shown"
    return clipped(text, limit)


def bounded_line(text: str, limit: int = LINE_MAX) -> str:
    """A message line of at most about ``limit`` characters: a longer one keeps its start (the file
    it names) and its end (the rule), its middle replaced by how much was cut. The backstop for what a
    message quotes without :func:`quoted`."""
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 3
    return f"{text[:head]}...({len(text) - head - tail:,} of {len(text):,} characters cut)...{text[-tail:]}"


class PyckptError(Exception):
    """Base class of pyckpt's own errors. A message (one text argument) is made :func:`printable_line`
    and :func:`bounded_line`: a name from a checkpoint inside it cannot forge a line of output, drive
    the terminal or fill it. The OSError form (errno, text, filename) is left alone: it shows the
    filename as repr does."""

    def __init__(self, *args):
        if len(args) == 1 and isinstance(args[0], str):
            args = (bounded_line(printable_line(args[0])), )
        super().__init__(*args)


class CheckpointFormatError(PyckptError, ValueError):
    """The input does not follow DeepSpeed's checkpoint format (missing or inconsistent files/keys)."""


class UnsafePickleError(PyckptError):
    """A pickle asked for something outside the allowlist; nothing from it was imported or run."""


class OutputExistsError(PyckptError, FileExistsError):
    """The output folder exists and overwriting was not requested."""


class UnsupportedCheckpointError(PyckptError, NotImplementedError):
    """A valid checkpoint layout that this converter (like DeepSpeed's) does not handle."""


class AutoEPError(CheckpointFormatError, RuntimeError):
    """AutoEP (expert-parallel) metadata or expert state is malformed or inconsistent.

    A RuntimeError, as DeepSpeed raises for the same cases, and a CheckpointFormatError.
    """


class MissingExpertFileError(CheckpointFormatError, FileNotFoundError):
    """AutoEP metadata promises a per-expert file that is not in the checkpoint folder."""


class InputChangedError(PyckptError, OSError):
    """An input file changed (shrank) while pyckpt was reading it; what was read is discarded."""


class PlanCheckError(PyckptError, ValueError):
    """The native executor refused the copy plan: a rule the planner enforces was broken anyway.

    Seeing one means a bug in pyckpt or an input that got past its checks; nothing was published."""


class RanksFailedError(PyckptError, RuntimeError):
    """A step of a run spread over several processes failed on one or more of them; every process
    raises this, naming each failing rank and its message (``failures``: rank -> message)."""

    def __init__(self, what: str, failures: dict, size: int):
        self.what, self.failures, self.size = what, dict(sorted(failures.items())), size
        super().__init__(self._message())

    @staticmethod
    def describe(exc: BaseException) -> str:
        """One line for another rank's message: the exception's kind (unless it is pyckpt's own, whose
        text says what happened) and its text."""
        text = " ".join(str(exc).split()) or type(exc).__name__
        return text if isinstance(exc, PyckptError) else f"{type(exc).__name__}: {text}"

    def _message(self) -> str:
        by_message: dict = {}
        for rank, message in self.failures.items():
            by_message.setdefault(message, []).append(rank)
        parts = [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {message}"
                 for message, ranks in by_message.items()]
        return f"{self.what} failed on {len(self.failures)} of {self.size} ranks; {'; '.join(parts)}"


class VerifyInputError(CheckpointFormatError):
    """OUTPUT is not a universal folder, or INPUT (``against``) cannot be read or planned."""


class TpMergeError(CheckpointFormatError, AssertionError):
    """A merge rule's precondition failed (DeepSpeed asserts the same)."""


class RankLoadError(RanksFailedError):
    """Another rank could not do its part of a load. A load fails together: the ranks that failed
    raise their own errors, every other rank this one, naming the first failing rank, before any
    rank changes its state."""

    @staticmethod
    def describe(exc: BaseException) -> str:
        return f"{type(exc).__name__}: {exc}"

    def _message(self) -> str:
        rank, message = next(iter(self.failures.items()))
        more = len(self.failures) - 1
        return (f"pyckpt: {self.what} failed on rank {rank} ({message})"
                + (f" and {more} more rank(s)" if more else "") + "; no rank changed its state")


class CollectiveCallError(PyckptError, RuntimeError):
    """A collective pyckpt call was not made by every rank of the process group."""


class SaveError(PyckptError, RuntimeError):
    """The checkpoint was not saved (or not converted); raised on every rank with every failing
    rank's message. ``published`` says whether the DeepSpeed checkpoint itself is in place."""

    def __init__(self, message: str, published: bool = False):
        super().__init__(message)
        self.published = published


class OutputLockError(PyckptError, OSError):
    """The output's lock could not be taken."""


class PointerNameError(PyckptError, ValueError):
    """A pointer file could not name the output so that DeepSpeed finds it again."""


@contextlib.contextmanager
def metadata_errors(folder):
    """Last line of defence: a lookup or arithmetic failure while reading metadata is a malformed
    checkpoint, reported as such with the folder named (each file's own checks name the file; this
    catches what they do not yet cover)."""
    try:
        yield
    except PyckptError:
        raise
    except (KeyError, IndexError, TypeError, AttributeError, ZeroDivisionError, OverflowError, ValueError,
            RecursionError) as exc:
        detail = f"missing key {quoted(exc.args[0])}" if isinstance(exc, KeyError) and exc.args else str(exc)
        raise CheckpointFormatError(f"{os.fspath(folder)}: malformed checkpoint metadata ({type(exc).__name__}: "
                                    f"{clipped(' '.join(detail.split()), 300)})") from exc


# -- numbers a caller passes -------------------------------------------------------------------

def check_number(name: str, value, *, integer: bool = False, low=None, high=None, low_open: bool = False):
    """``value`` if it is a finite number (an integer with ``integer``) from ``low`` to ``high`` (either
    end may be None; ``low`` itself excluded with ``low_open``); else a ValueError naming ``name`` and
    the range. A bool is not a number here."""
    kind = numbers.Integral if integer else numbers.Real
    ok = isinstance(value, kind) and not isinstance(value, bool) and (integer or math.isfinite(value))
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        raise ValueError(f"{name} must be {number_rule(integer, low, high, low_open)}, not {_shown(value)}")
    return value


def _shown(value) -> str:
    # a long integer is no help in a message (and repr of a 5,000-digit one raises)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(value).bit_length() > 200:
        return f"an integer of {abs(value).bit_length()} bits"
    return quoted(value, 80)


def number_rule(integer: bool = False, low=None, high=None, low_open: bool = False) -> str:
    """What :func:`check_number` asks for, in words."""
    what = "an integer" if integer else "a finite number"
    if low == 0 and high is None:
        sign = "positive" if low_open else "non-negative"
        return f"a {sign} integer" if integer else f"a finite {sign} number"
    if low is not None and high is not None and not low_open:
        return f"{what} from {low} to {high}"
    parts = [f"{'>' if low_open else '>='} {low}"] if low is not None else []
    parts += [f"<= {high}"] if high is not None else []
    return f"{what} {' and '.join(parts)}".rstrip()


# More copy threads than any machine has cores is a typo (the executor itself runs at most 1,024).
WORKERS_MAX = 1 << 16


def check_workers(workers, name: str = "workers"):
    """``workers`` as the library's entry points take it: None or 0 (one thread per core) up to
    :data:`WORKERS_MAX`; else a ValueError naming ``name``."""
    return workers if workers is None else check_number(name, workers, integer=True, low=0, high=WORKERS_MAX)


class MemoryRootError(PyckptError, OSError):
    """A memory-tier folder (the root, a job's or a node's folder under it) is refused: a link, not a
    folder, another user's, writable by group or others, or on a filesystem that cannot be asked for
    its free space. Nothing was written in it."""


class ReplicationError(PyckptError, OSError):
    """A checkpoint folder could not be replicated to a peer node's memory tier: the receiver refused
    it (the reason it gave is in the message), it did not prove it holds the job's token, the
    connection failed, or the folder holds something that is not a regular file or folder."""
