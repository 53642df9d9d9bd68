"""Whose a memory checkpoint is: the job folder a save dir's checkpoints go to, and the run that made them.

Every job on a node shares the memory root, so a job's folder under it must be its own and no other
job's, or one job resumes, copies or removes another's checkpoints. A job that names itself
(``MemoryTier(job=...)``, ``$PYCKPT_JOB_ID``, torchrun's ``--rdzv-id`` or the fresh id of ``torchrun
--standalone``) has its folder under that name. A job that names nothing gets a name every such job
shares ("default" under the ``deepspeed`` launcher, ``srun`` or plain ``python``; "none" under torchrun
without ``--rdzv-id``), so its folder is named after the real path of its save dir instead:
``default-<16 hex digits>``. That is a key such a job keeps across torchrun restarts and relaunches
(they save to the same folder), and one two different jobs never share (two jobs never save to one
folder).

The folder also says whose it is: ``pyckpt-job.json`` beside the node folders records the save dir's
real path and the run, a random id drawn at the job's first memory save and kept while the folder
lives (torchrun restarts and relaunches after a crash find it again; a normal end removes the folder,
and the next run draws a new one). Every node share records both too (:mod:`.node_manifest`). A save
into a folder another save dir's job holds (two jobs given one id) is refused; recovery, retention and
the copy made at a normal end take only the shares of the recorded run and save dir, and a job removes
its folder only while the record there is its own.

The record is read like anything in the tier: opened relative to the checked job folder without
following a link, a regular file of a few bytes, strict JSON.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import re
import stat
from dataclasses import dataclass
from typing import List, Optional

from ...errors import CheckpointFormatError, MemoryRootError, quoted
from ...execution.control_characters import first_control
from ...formats.json_file import parse_json_object
from .folder_names import JOB_RECORD, check_job_name
from .memory_root import _open_level, _root_fd

ENV_JOB = "PYCKPT_JOB_ID"
# torchrun's rendezvous id: the same for every elastic restart of one job (a fresh uuid per
# `torchrun --standalone`, the --rdzv-id given otherwise, "none" when that is not given).
ENV_RUN_ID = "TORCHELASTIC_RUN_ID"
DEFAULT_JOB = "default"

RECORD = JOB_RECORD
VERSION = 1
# torchrun's run id when --rdzv-id is not given: every such job has it
TORCHRUN_NO_ID = "none"
MAX_BYTES = 64 * 1024
_RUN = re.compile(r"[0-9a-f]{32}\Z")
_JOB = "the job's memory folder"


def job_id(explicit: Optional[str] = None) -> str:
    """The job's folder name under the root: ``explicit``, else ``$PYCKPT_JOB_ID``, else torchrun's
    ``$TORCHELASTIC_RUN_ID`` (stable across elastic restarts of one job), else ``"default"``. An unset
    or empty variable counts as absent. A name that is not one folder name (``[A-Za-z0-9._-]{1,128}``,
    not starting with '.') is a ValueError naming it and where it came from."""
    if explicit is not None:
        return check_job_name(explicit)
    for name in (ENV_JOB, ENV_RUN_ID):
        value = os.environ.get(name)
        if value:
            return check_job_name(value, f"${name}")
    return DEFAULT_JOB


@dataclass(frozen=True)
class Identity:
    """Which job folder a save dir's memory checkpoints go to."""

    job: str  # the folder's name under the root
    save_dir: str  # the real path of the save dir
    derived: bool  # the job named no id of its own: the folder is named after save_dir


@dataclass(frozen=True)
class JobRecord:
    """What ``<root>/<job>/pyckpt-job.json`` says: the run and the save dir its checkpoints belong to."""

    run: str
    save_dir: str

    def to_json(self) -> bytes:
        import json

        return json.dumps({"pyckpt_job": VERSION, "run": self.run, "save_dir": self.save_dir}, ensure_ascii=True,
                          separators=(",", ":")).encode()


def real_save_dir(save_dir) -> str:
    """The real path of ``save_dir`` (links resolved, as far as it exists): what identifies it."""
    return os.path.realpath(os.path.abspath(os.fspath(save_dir)))


def save_dir_problem(value) -> str:
    """Why ``value`` (read from a manifest or record) cannot be a save dir's real path; '' if it can."""
    if not isinstance(value, str) or not value.startswith("/") or not 0 < len(value) <= 4096:
        return "is not an absolute path of at most 4096 characters"
    if first_control(value):
        return "contains a control character"
    return ""


def run_problem(value) -> str:
    return "" if isinstance(value, str) and _RUN.match(value) else "is not a run id (32 hex digits)"


def new_run() -> str:
    return os.urandom(16).hex()


def identify(job: Optional[str], save_dir) -> Identity:
    """The job folder for ``save_dir``'s checkpoints: ``job`` (a tier's explicit name), else
    ``$PYCKPT_JOB_ID``, else torchrun's run id; where that leaves the name every job without one of its
    own gets, the folder is named after ``save_dir``'s real path."""
    real = real_save_dir(save_dir)
    name = job_id(job)
    if not named(job):
        digest = hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest()[:16]
        return Identity(f"{name}-{digest}", real, True)
    return Identity(name, real, False)


def named(job: Optional[str]) -> bool:
    """Whether the job folder's name is the job's own (``job``, ``$PYCKPT_JOB_ID`` or torchrun's run id),
    not one :func:`identify` derives from the save dir."""
    torchrun = os.environ.get(ENV_RUN_ID)
    return job is not None or bool(os.environ.get(ENV_JOB)) or bool(torchrun and torchrun != TORCHRUN_NO_ID)


def bound(tier, save_dir):
    """``(tier naming its job folder for save_dir, the Identity)``: the tier every step of a save or a
    recovery for ``save_dir`` uses, so that all of them name the same folder."""
    found = identify(tier.job, save_dir)
    return dataclasses.replace(tier, job=found.job), found


def _job_fd(root: str, job: str, create: bool) -> Optional[int]:
    path, root_fd = _root_fd(root, create)
    try:
        return _open_level(root_fd, job, os.path.join(path, job), _JOB, create)
    finally:
        os.close(root_fd)


def read_record(root: str, job: str) -> Optional[JobRecord]:
    """The record of ``<root>/<job>``, or None where the root, the folder or the record is absent.
    A record that is there but no regular file of ours, or not a record, is a MemoryRootError naming it
    (the folder's owner is then unknown: nothing may take it for its own)."""
    try:
        fd = _job_fd(root, job, False)
    except FileNotFoundError:
        return None
    if fd is None:
        return None
    path = os.path.join(os.path.abspath(root), job, RECORD)
    try:
        try:
            f = os.open(RECORD, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            why = "a symbolic link" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
            raise MemoryRootError(f"{path}: the job's record cannot be read ({why}); remove the job's memory folder "
                                  f"(pyckpt clean --memory {job})") from None
        try:
            st = os.fstat(f)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > MAX_BYTES:
                raise MemoryRootError(f"{path}: the job's record is not a small regular file of ours; remove the job's "
                                      f"memory folder (pyckpt clean --memory {job})")
            data = os.read(f, MAX_BYTES + 1)
        finally:
            os.close(f)
    finally:
        os.close(fd)
    try:
        body = parse_json_object(data, path, "pyckpt job record")
        if body.get("pyckpt_job") != VERSION:
            raise CheckpointFormatError(f"{path}: not a version {VERSION} pyckpt job record")
        for key, rule in (("run", run_problem), ("save_dir", save_dir_problem)):
            problem = rule(body.get(key))
            if problem:
                raise CheckpointFormatError(f"{path}: its {key} {quoted(body.get(key))} {problem}")
    except CheckpointFormatError as exc:
        raise MemoryRootError(f"{exc}; remove the job's memory folder (pyckpt clean --memory {job})") from None
    return JobRecord(body["run"], body["save_dir"])


def foreign(record: Optional[JobRecord], identity: Identity, root: str) -> Optional[str]:
    """Why the job folder holding ``record`` is not ``identity``'s (another save dir's), or None."""
    if record is None or record.save_dir == identity.save_dir:
        return None
    where = os.path.join(os.path.abspath(root), identity.job)
    return (f"{where} holds the memory checkpoints of the job saving to {quoted(record.save_dir)}, not to "
            f"{quoted(identity.save_dir)}: two jobs were given the job id {identity.job!r}; give each job an id of "
            f"its own (${ENV_JOB} or MemoryTier(job=...))")


def any_foreign(records, identity: Identity, root: str) -> Optional[str]:
    """Why the first of ``records`` (every node's record, or None) that is another save dir's job's is not
    ``identity``'s folder (:func:`foreign`), or None."""
    return next((f for f in (foreign(record, identity, root) for record in records) if f), None)


def agreed_run(records: List[Optional[JobRecord]], identity: Identity) -> Optional[str]:
    """The job's run from every node's record (in node order): the first recorded for this save dir."""
    for record in records:
        if record is not None and record.save_dir == identity.save_dir:
            return record.run
    return None


def claim(root: str, identity: Identity, run: str) -> JobRecord:
    """This node's leader: ``<root>/<job>`` recorded as ``run``'s of ``identity.save_dir`` before a share
    goes into it. An absent record is created (atomically: a complete file or none); one of this save
    dir under another run (left by an earlier run on this node) is replaced; one of another save dir is a
    MemoryRootError (:func:`foreign`)."""
    record = JobRecord(run, identity.save_dir)
    existing = read_record(root, identity.job)
    problem = foreign(existing, identity, root)
    if problem:
        raise MemoryRootError(problem)
    if existing == record:
        return record
    fd = _job_fd(root, identity.job, True)
    tmp = f".{RECORD}.{os.getpid()}-{os.urandom(4).hex()}"
    try:
        f = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
        try:
            os.write(f, record.to_json())
        finally:
            os.close(f)
        if existing is None:
            try:  # never over a record another rank or job wrote meanwhile
                os.link(tmp, RECORD, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
            except FileExistsError:
                pass
        else:
            os.replace(tmp, RECORD, src_dir_fd=fd, dst_dir_fd=fd)
    finally:
        try:
            os.unlink(tmp, dir_fd=fd)
        except FileNotFoundError:
            pass
        os.close(fd)
    now = read_record(root, identity.job)
    problem = foreign(now, identity, root)
    if problem:
        raise MemoryRootError(problem)
    return now


def owns(manifest, identity: Identity, run: Optional[str] = None) -> bool:
    """Whether a node share (its manifest) is one of ``identity``'s checkpoints (of its job folder and
    save dir), and of ``run``'s where one is given."""
    return (manifest.job == identity.job and manifest.save_dir == identity.save_dir
            and (run is None or manifest.run == run))
