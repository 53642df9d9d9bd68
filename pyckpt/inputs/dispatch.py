"""What an input path is, and the reader that opens it: the one place that tells a
torch.distributed.checkpoint (DCP) folder from a DeepSpeed checkpoint.

Two kinds, told apart by the DCP reader's own rule (:func:`pyckpt.dcp.read.is_dcp_folder`: a folder
holding ``.metadata``, or torch's sharded safetensors layout). Everything else is a DeepSpeed
checkpoint: a ZeRO tag folder or the folder holding ``latest``, or a Universal Checkpoint made from
one, which :func:`pyckpt.universal.input.discover_input` tells apart when the input is read. A path
that is neither (missing, a file, an empty folder) is refused by that reader, in one line naming the
path and the rule, so that deciding the kind reads nothing and raises nothing: a command checks its
flags against the kind before any file is opened.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..dcp.read import is_dcp_folder

DCP = "dcp"
DEEPSPEED = "deepspeed"


@dataclass(frozen=True)
class InputCheckpoint:
    """A checkpoint given as ``path``, of ``kind`` DCP or DEEPSPEED; nothing of it read yet."""

    path: str
    kind: str

    def read(self):
        """The checkpoint as its reader gives it: a :class:`pyckpt.dcp.read.DcpCheckpoint` (entries and
        chunks), or a ZeRO or Universal Checkpoint's discovered files (``ZeroCheckpoint``,
        ``UniversalCheckpoint``). The reader's error, naming the file and the rule, when it refuses."""
        from ..errors import metadata_errors
        with metadata_errors(self.path):
            if self.kind == DCP:
                from ..dcp.read import read_dcp
                return read_dcp(self.path)
            from ..universal.input import discover_input
            return discover_input(self.path)


def open_checkpoint(path) -> InputCheckpoint:
    """The checkpoint at ``path``: a DCP folder, or else a DeepSpeed checkpoint (see the module)."""
    path = os.fspath(path)
    return InputCheckpoint(path, DCP if is_dcp_folder(path) else DEEPSPEED)
