"""What a verification found: one problem per defect, collected rather than raised, and the
counts a user reads before deleting the source checkpoint."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class Problem:
    path: str
    problem: str

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


@dataclass
class VerifyReport:
    output: str
    against: Optional[str] = None
    stage: Optional[int] = None
    params: int = 0
    files: int = 0
    bytes_checked: int = 0
    content_checked: int = 0  # tensors whose bytes were compared with the input (``against``)
    content_skipped: int = 0  # planned tensors too large to assemble or not comparable
    problems: List[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, path, problem: str) -> None:
        self.problems.append(Problem(os.fspath(path), " ".join(str(problem).split())))

    def summary(self) -> str:
        if self.ok:
            text = (f"OK: {self.params} parameters, {self.files} files, {self.bytes_checked / 2**30:.3f} GiB checked")
            if self.against:
                text += f", matches {self.against}"
                if self.content_checked:
                    text += f" ({self.content_checked} tensors compared by CRC-32)"
            return text
        return f"FAILED: {len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}"

    def to_dict(self) -> dict:
        return {"ok": self.ok, "output": self.output, "against": self.against, "stage": self.stage,
                "params": self.params, "files": self.files, "bytes_checked": self.bytes_checked,
                "content_checked": self.content_checked, "content_skipped": self.content_skipped,
                "problems": [{"path": p.path, "problem": p.problem} for p in self.problems],
                "summary": self.summary()}


class Progress:
    """A byte counter on stderr, shown only on a terminal (as the converter's bar)."""

    def __init__(self, folder: str):
        total = 0
        for dirpath, _, filenames in os.walk(folder):
            for f in filenames:
                try:
                    total += os.path.getsize(os.path.join(dirpath, f))
                except OSError:
                    pass
        from tqdm import tqdm
        self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                         desc="pyckpt verify", leave=False, disable=None)

    def update(self, n: int) -> None:
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()
