"""What one call of ``save_checkpoint`` asks for, as one value: :class:`SaveRequest`.

Every step of a save (the preflight, DeepSpeed's save into staging, the background write, the
publication, the conversions, a memory save's detour through the node folders) reads the options it
needs from the request instead of a long list of arguments passed along, and a memory save hands the
same request on with the few fields it changes (:func:`dataclasses.replace`). The checks of the
arguments live here too, so that every entry refuses the same values with the same messages.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from ...errors import quoted
from ...execution.tag_rule import tag_problem


@dataclasses.dataclass(frozen=True)
class SaveRequest:
    """The arguments of :func:`pyckpt.deepspeed.save_checkpoint` (see there), less the engine saved and
    the memory tier."""

    save_dir: Any
    tag: Optional[str] = None
    tokenizer: Any = None
    model_config: Any = None
    client_state: Optional[dict] = None
    on_error: str = "raise"
    universal: bool = False
    export: Optional[str] = None
    exclude_frozen_parameters: bool = False
    arrival_timeout: float = 300.0
    fsync: bool = False
    async_save: bool = False
    keep_last: Optional[int] = None
    agree_timeout: float = 1800.0
    snapshot_limit: Optional[int] = None
    # DeepSpeed's own save_checkpoint(save_latest=False) leaves `latest` alone; a save made for DeepSpeed's
    # caller (enable(save=...)) writes only DeepSpeed's files, without pyckpt's training_state.json
    save_latest: bool = True
    training_state: bool = True

    def checked(self) -> "SaveRequest":
        """The request, once every argument is one a save can take; ValueError naming the first that is not."""
        if self.on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', not {self.on_error!r}")
        if self.export not in (None, "hf"):
            raise ValueError(f"export must be None or 'hf', not {self.export!r}")
        if not self.save_dir:
            raise ValueError(f"save_dir must be a non-empty path, got {self.save_dir!r}")
        keep_last = self.keep_last
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be None or a positive number of checkpoints, not {keep_last!r}")
        limit = self.snapshot_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"snapshot_limit must be None or a number of bytes, not {limit!r}")
        import threading  # its longest wait bounds both: a longer one raises OverflowError mid-save, not here
        from ...errors import check_number
        for key, seconds in (("arrival_timeout", self.arrival_timeout), ("agree_timeout", self.agree_timeout)):
            check_number(key, seconds, low=0, low_open=True, high=threading.TIMEOUT_MAX)
        return self

    def resolved(self, engine) -> "SaveRequest":
        """The request with an absolute ``save_dir`` and a checked tag (DeepSpeed's ``global_step<N>`` by default)."""
        tag = check_tag(str(self.tag if self.tag is not None else f"global_step{engine.global_steps}"))
        return dataclasses.replace(self, save_dir=os.path.abspath(os.fspath(self.save_dir)), tag=tag)

    def shape(self) -> dict:
        """The arguments that decide which collectives and store rounds follow: every rank must pass the
        same (the preflight compares them)."""
        return {"async_save": bool(self.async_save), "keep_last": self.keep_last, "universal": bool(self.universal),
                "export": self.export, "snapshot_limit": self.snapshot_limit, "on_error": self.on_error,
                "exclude_frozen_parameters": bool(self.exclude_frozen_parameters),
                "save_latest": bool(self.save_latest), "training_state": bool(self.training_state)}


def check_tag(tag: str) -> str:
    """``tag`` when it may name a checkpoint's folder (:func:`~pyckpt.execution.tag_rule.tag_problem`),
    else a ValueError in one line, before anything runs."""
    problem = tag_problem(tag)
    if problem:
        raise ValueError(f"checkpoint tag {quoted(tag)} {problem}; nothing was written")
    return tag
