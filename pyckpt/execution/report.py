"""What a run that writes an output reports, shared by the reports of convert, export and the DCP export.

Each report is a dataclass of its own fields (what was read and written differs by format) with
``bytes_written``, ``seconds`` and ``plan_text`` among them; this mixin gives them one rate, one
closing-line tail and one JSON form, so ``--json`` reads alike for every verb.
"""

from __future__ import annotations

from dataclasses import asdict


class WrittenReport:
    bytes_written: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes_written / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def took(self, stats: dict, seconds: float) -> None:
        """Record a finished write: ``stats`` as the publisher returns them, the run's wall time."""
        self.bytes_written = stats["bytes_written"]
        self.seconds = seconds

    def written(self) -> str:
        """The closing line's tail: '<GB> GB in <s> s (<rate> GB/s)'."""
        return f"{self.bytes_written / 1e9:.3f} GB in {self.seconds:.2f} s ({self.gbps:.2f} GB/s)"

    def to_dict(self) -> dict:
        """Every field but the dry run's plan text (printed, not reported), and the rate."""
        d = asdict(self)
        d.pop("plan_text")
        d["gbps"] = self.gbps
        return d
