"""The names the memory tier gives its folders and files, in one place:

    <root>/<job>/pyckpt-job.json                  the job folder's record (job_identity)
    <root>/<job>/node<N>/                         a node's memory folder (memory_root)
    <root>/<job>/node<N>/<tag>/pyckpt-node.json   a node share's manifest (node_manifest)
    <root>/<job>/node<N>/replica-of-node<M>/<tag> node M's share, kept here (replica_receiver)
    <root>/<job>/node<N>/restore/<tag>            the checkpoint a recovery put together (memory_recovery)
    <root>/<job>/node<N>/restore/checkpoint-<S>/<tag>  the same, as the Trainer's folder (memory_trainer)
    <root>/<job>/node<N>/.pyckpt-slot/            a retired share whose files the next save writes over
    <root>/<job>/node<N>/.pyckpt-slot-next/       the slot after it, made before a job's first save

A tag folder lies at most :data:`LEVELS_ABOVE_TAG` folders below the job's folder (the Trainer's
folder in ``restore``, its staging beside it alike), so a walk of a job's tree goes no deeper than that
and a tag folder's own depth (:data:`.folder_walk.TAG_DEPTH`).

Node numbers are written without leading zeros and read back only in that form, so one node has one
folder name.
"""

from __future__ import annotations

import re
from typing import Optional

from ...errors import quoted

JOB_RECORD = "pyckpt-job.json"
MANIFEST = "pyckpt-node.json"
RESTORE = "restore"
SLOT = ".pyckpt-slot"
NEXT_SLOT = ".pyckpt-slot-next"
REPLICA_PREFIX = "replica-of-node"
LEVELS_ABOVE_TAG = 4  # node<N>/restore/checkpoint-<S>/<tag>
_NODE_PREFIX = "node"
_NUMBER = r"(0|[1-9][0-9]{0,9})"
_NODE = re.compile(_NODE_PREFIX + _NUMBER)
_REPLICA = re.compile(REPLICA_PREFIX + _NUMBER)
_JOB_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


def job_name_problem(job) -> str:
    """Why ``job`` cannot name a job's folder under the root, or ''."""
    if not isinstance(job, str) or not _JOB_NAME.fullmatch(job) or job.startswith("."):
        return "must be one folder name: 1 to 128 of the characters A-Z a-z 0-9 . _ -, not starting with '.'"
    return ""


def check_job_name(job, source: str = "job id") -> str:
    """``job`` when it may name a job's folder (:func:`job_name_problem`), else a ValueError naming it
    and where it came from (``source``)."""
    problem = job_name_problem(job)
    if problem:
        shown = quoted(job, 77) if isinstance(job, str) else type(job).__name__
        raise ValueError(f"{source} {shown} {problem}")
    return job


def tag_reserved(tag: str) -> Optional[str]:
    """Why ``tag`` cannot name a memory checkpoint (it names a folder or file the tier keeps beside
    its tags), or None. The rule every tag follows is :func:`~pyckpt.execution.tag_rule.tag_problem`."""
    if tag == RESTORE or tag.startswith(REPLICA_PREFIX) or tag == MANIFEST:
        return f"is a name the memory tier keeps for its own folders ({RESTORE}, {REPLICA_PREFIX}<N>)"
    return None


def node_folder(node: int) -> str:
    """``node<N>``: a node's memory folder, for a node number already checked."""
    return f"{_NODE_PREFIX}{node}"


def node_of_folder(name: str) -> Optional[int]:
    """N of a folder named exactly ``node<N>``, else None."""
    m = _NODE.fullmatch(name)
    return int(m.group(1)) if m else None


def replica_folder(node: int) -> str:
    """``replica-of-node<N>``: where node N's shares are kept on its peer."""
    return f"{REPLICA_PREFIX}{node}"


def is_replica_folder(name: str) -> bool:
    return _REPLICA.fullmatch(name) is not None
