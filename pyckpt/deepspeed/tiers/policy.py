"""Where a job keeps its checkpoints besides durable storage, and how often it persists them: the one
place the memory tier's policy lives.

A :class:`MemoryTier` names a node-local memory root (tmpfs: ``/dev/shm`` by default), the job's
folder in it, how many checkpoints stay there, how often one is also persisted to the durable
``save_dir``, and a byte limit. The files in it are DeepSpeed's own, byte for byte, published by the
same agreed atomic rule as a durable save, so every reader works on them unchanged; what is new is
only where a save goes and which tier a resume reads (:mod:`.resume_choice`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...errors import check_number
from .job_identity import job_id
from .memory_root import default_root, node_memory_folder, open_root
from .nodes import this_node


@dataclass(frozen=True)
class MemoryTier:
    """The memory tier of one job.

    ``root``: the node-local memory root (default ``$PYCKPT_MEMORY_ROOT``, else ``/dev/shm/pyckpt-<uid>``),
    made mode 0700 and refused when it is a link, another user's, or writable by others. ``job``: the
    job's folder under it (default ``$PYCKPT_JOB_ID``, else torchrun's run id, which survives elastic
    restarts; a job with neither, as under the ``deepspeed`` launcher, ``srun``, plain ``python`` or
    torchrun without ``--rdzv-id``, gets a folder named after its save dir's real path,
    :mod:`.job_identity`). ``keep``: checkpoints kept in memory (the newest by step). ``persist_every``: every N-th
    memory checkpoint is also copied to the durable ``save_dir`` in the background (None: only when
    ``save_checkpoint(..., persist=True)`` asks). ``limit_bytes``: the most this job's memory folders
    may hold, besides the filesystem's own free space. ``keep_at_exit``: a process that saved to the
    tier and ends without an uncaught exception first persists the newest memory checkpoint to
    ``save_dir`` (where it is newer than what ``save_dir`` holds), then removes the job's memory
    folder, unless this is True; a crash (an uncaught exception, a signal) always leaves it for the
    restart.

    On several nodes (torchrun's ``GROUP_RANK`` / ``LOCAL_WORLD_SIZE``) each node keeps its own ranks'
    files in its own root, and a replica of the previous node's in the ring (the newest ``keep`` of
    those too); a restart recovers the newest checkpoint every node's share of which a live node holds
    (:mod:`.resume_choice`). A job relaunched from scratch with a new torchrun run id (``--standalone``) finds
    its memory only under the same ``job`` name: set it (or ``$PYCKPT_JOB_ID``) for such jobs. Whatever
    the name, a memory checkpoint belongs to the save dir it was saved for: a save, a recovery and the
    end of a job take only those of their own save dir."""

    root: Optional[str] = None
    job: Optional[str] = None
    keep: int = 2
    persist_every: Optional[int] = None
    limit_bytes: Optional[int] = None
    keep_at_exit: bool = False

    def __post_init__(self):
        check_number("keep", self.keep, integer=True, low=1)
        if self.persist_every is not None:
            check_number("persist_every", self.persist_every, integer=True, low=1)
        if self.limit_bytes is not None:
            check_number("limit_bytes", self.limit_bytes, integer=True, low=0)
        job_id(self.job)  # a job name that is no folder name is refused here, not at the first save

    @property
    def root_path(self) -> str:
        return open_root(self.root or default_root())

    @property
    def job_name(self) -> str:
        return job_id(self.job)

    def folder(self, node: Optional[int] = None) -> str:
        """This node's folder of the job (created mode 0700, checked), where its ranks' files go."""
        return node_memory_folder(self.root_path, self.job_name, this_node() if node is None else node)


def one_tier(tier, memory, name: str):
    """The tier a call was given as ``name=`` or by its former keyword ``memory=`` (which named both where a
    save goes and where a resume looks); ValueError when it was given two different ones."""
    if tier is not None and memory is not None and tier is not memory:
        raise ValueError(f"{name}= and memory= (its former name) were both given; pass {name}= only")
    return tier if tier is not None else memory
