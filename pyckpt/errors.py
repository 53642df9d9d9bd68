"""The exceptions pyckpt raises on purpose, and the one rule that turns a stray lookup failure into one.

Every error about input names the file and the rule it broke, so a user can act on one line.
"""

import contextlib
import os


class PyckptError(Exception):
    """Base class of pyckpt's own errors."""


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
        detail = f"missing key {exc.args[0]!r}" if isinstance(exc, KeyError) and exc.args else str(exc)
        raise CheckpointFormatError(f"{os.fspath(folder)}: malformed checkpoint metadata ({type(exc).__name__}: "
                                    f"{' '.join(detail.split())[:300]})") from exc
