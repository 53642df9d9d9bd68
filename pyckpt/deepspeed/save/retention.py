"""``keep_last``: after a save is published, older checkpoints beyond the K newest are removed.

What the Hugging Face Trainer calls ``save_total_limit``, done so that no fault costs the newest
complete checkpoint and nothing but this job's own checkpoints is ever removed:

* **What counts** is read, not guessed from names: a folder is one of this job's checkpoints only
  when its model-state file of model-parallel rank 0 (``mp_rank_00_model_states.pt``, or
  ``zero_pp_rank_0_mp_rank_00_model_states.pt`` under ZeRO-3) is a regular file of the folder
  whose pickle, read by pyckpt's allowlist reader (never run), is DeepSpeed's model-state dict
  (``ds_version``, ``global_steps``, the world sizes) and names the same parameters with the same
  shapes as the checkpoint just published (:class:`JobCheckpoint`). A user's ``analysis/`` folder,
  another model's checkpoint, a folder whose file is a link, junk, or unreadable: none counts.
* **Order** is the step each checkpoint records (``global_steps``), then the tag name: folder
  times change when anyone touches a folder and say nothing about training progress. The tag just
  published always counts as the newest.
* **Never removed**: the folder ``latest`` or ``latest_universal`` names (a pointer that cannot be
  read stops pruning: PointerUnreadable), one whose output lock another run holds, a link.
* A checkpoint's own conversions (``<tag>_universal``, ``<tag>_hf``) go with it only when they are
  what pyckpt writes there (a Universal Checkpoint of this job; a folder holding only a Hugging Face
  export's files) and no pointer names them.

Each removal first renames the folder to a hidden staging name under its lock (one atomic step: a
checkpoint is whole or gone from view), then deletes it; a kill between the two leaves a staging
folder that the next save removes.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from typing import List, Optional, Tuple

from ...universal.layout import STATES_FOLDER
from ...errors import CheckpointFormatError, OutputLockError
from ...formats.torch_zip import read_capped, regular_fd
from ...zero.discovery import natural_key
from ..tiers.checkpoint_record import FIRST_MODEL_STATES, JobCheckpoint, read_checkpoint
from ...huggingface.files import COMPANION_FILES, SAFE_WEIGHTS_INDEX_NAME
from ...execution.leftovers import remove_path
from ...execution.output_lock import OutputLock
from ...execution.pointer import POINTERS
from ...execution.staging_names import STAGING, hidden_name, owner_id

log = logging.getLogger("pyckpt")

CONVERSIONS = ("_universal", "_hf")
# What pyckpt's Hugging Face export writes: the weights (one file, or shards and their index) and the
# companions it copies from beside the checkpoint.
_HF_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
_HF_FILES = frozenset(COMPANION_FILES) | {SAFE_WEIGHTS_INDEX_NAME, "training_state.json"}


class PointerUnreadable(OSError):
    """A pointer file that is there but is no regular file of the folder (a link, a FIFO, a folder)."""


def read_pointer(save_dir: str, pointer: str = "latest") -> Optional[str]:
    """The name ``save_dir/<pointer>`` holds, as DeepSpeed reads it (stripped), or None if there is
    no such file. A pointer that is a link (to a secret, to /proc) or anything but a regular file
    is not followed or read: PointerUnreadable. O_NONBLOCK keeps a FIFO from blocking the open."""
    path = os.path.join(save_dir, pointer)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symbolic link
        raise PointerUnreadable(exc.errno, f"{path}: not a regular file ({exc.strerror})") from None
    try:
        fd = regular_fd(fd, path)
        data = read_capped(fd, path, POINTER_BYTES)
    except CheckpointFormatError as exc:
        raise PointerUnreadable(errno.EINVAL, str(exc)) from None
    return data.decode("utf-8", errors="replace").strip() or None


POINTER_BYTES = 4096  # a tag name; anything longer names no checkpoint pyckpt or DeepSpeed wrote


def _pointed(save_dir: str) -> set:
    """The names the pointers hold; PointerUnreadable if one cannot be read, since pruning without
    knowing what it names could remove the checkpoint a resume would load."""
    return {name for name in (read_pointer(save_dir, p) for p in POINTERS) if name}


def is_checkpoint(folder: str) -> bool:
    """Whether ``folder`` (not a link) holds a DeepSpeed checkpoint: what a save may replace."""
    return not os.path.islink(folder) and os.path.isdir(folder) and read_checkpoint(folder) is not None


def replace_problem(output: str, kind: str = "checkpoint", reference: Optional[JobCheckpoint] = None) -> Optional[str]:
    """Why a save must not replace ``output`` (an existing tag folder or a conversion of it), or None.
    ``kind`` is "checkpoint", "_universal" or "_hf": what pyckpt writes there. With ``reference`` (the
    record of the checkpoint about to take its place), a checkpoint must also be of the same job."""
    if not os.path.lexists(output):
        return None
    if os.path.islink(output) or not os.path.isdir(output):
        return f"{output} exists and is not a folder pyckpt wrote (a link or a file)"
    if kind == "_hf":
        return None if _is_hf_export(output) else (
            f"{output} exists and holds files a Hugging Face export does not write")
    if kind == "_universal":
        zero = os.path.join(output, STATES_FOLDER)
        if os.path.islink(zero) or not os.path.isdir(zero):
            return f"{output} exists and is not a Universal Checkpoint (no zero/ folder)"
    record = read_checkpoint(output)
    if record is None:
        return f"{output} exists and is not a DeepSpeed checkpoint (no readable {' or '.join(FIRST_MODEL_STATES)})"
    if reference is not None and not record.same_job(reference):
        return f"{output} exists and is a checkpoint of another model (other parameters or shapes)"
    return None


def _is_hf_export(folder: str) -> bool:
    """Only regular files an export writes, one of them weights: a folder holding anything else is
    someone's, not a conversion to remove or replace."""
    weights = False
    try:
        with os.scandir(folder) as it:
            for e in it:
                if not e.is_file(follow_symlinks=False):
                    return False
                if _HF_WEIGHTS.fullmatch(e.name):
                    weights = True
                elif e.name not in _HF_FILES:
                    return False
    except OSError:
        return False
    return weights


def _job_checkpoints(save_dir: str, reference: JobCheckpoint) -> List[Tuple[int, list, str]]:
    found = []
    with os.scandir(save_dir) as it:
        for e in it:
            if e.name.startswith(".") or not e.is_dir(follow_symlinks=False):
                continue
            if os.path.isdir(os.path.join(e.path, STATES_FOLDER)):  # a Universal Checkpoint: a conversion, not a save
                continue
            record = read_checkpoint(e.path)
            if record is not None and record.same_job(reference):
                found.append((record.step, natural_key(e.name), e.name))
    return found


def checkpoints(save_dir: str, newest: str, reference: Optional[JobCheckpoint] = None) -> List[str]:
    """This job's checkpoint tags in ``save_dir`` (those of ``newest``'s model), oldest first: by the
    step each records, then by name; ``newest`` last whatever its step. Empty when ``newest`` is no
    readable checkpoint (then nothing can be told to be this job's). ``reference``: ``newest``'s
    record, where the caller has read it already."""
    reference = reference or read_checkpoint(os.path.join(save_dir, newest))
    if reference is None:
        return []
    tags = [name for _, _, name in sorted(_job_checkpoints(save_dir, reference)) if name != newest]
    return tags + [newest]


def _remove(save_dir: str, name: str) -> bool:
    output = os.path.join(save_dir, name)
    try:
        lock = OutputLock(output, wait=False)
    except (OutputLockError, OSError):
        return False
    if not lock.held:
        return False  # another run (a conversion, a save of this tag) owns it
    try:
        doomed = os.path.join(save_dir, hidden_name(name, STAGING, owner_id()))
        try:
            os.rename(output, doomed)
        except FileNotFoundError:
            return False
        remove_path(doomed)
        return True
    finally:
        lock.release()


def keep_last(save_dir: str, k: int, newest: str) -> List[str]:
    """Removes this job's checkpoints of ``save_dir`` beyond the ``k`` newest; returns the names
    removed. ``newest`` (the tag just published) always counts as the newest, and tells which
    checkpoints are this job's (see the module doc)."""
    reference = read_checkpoint(os.path.join(save_dir, newest))
    tags = checkpoints(save_dir, newest, reference) if reference is not None else []
    if not tags:
        log.warning("pyckpt: keep_last=%d removed nothing: %s is no readable DeepSpeed checkpoint", k,
                    os.path.join(save_dir, newest))
        return []
    protected = _pointed(save_dir)
    removed = []
    for tag in tags[:-k] if k < len(tags) else []:
        if tag in protected:
            continue
        if _remove(save_dir, tag):
            removed.append(tag)
            for suffix in CONVERSIONS:
                name = tag + suffix
                path = os.path.join(save_dir, name)
                if name not in protected and os.path.lexists(path) and replace_problem(path, suffix, reference) is None \
                        and _remove(save_dir, name):
                    removed.append(name)
    for name in removed:
        log.info("pyckpt: removed %s (keep_last=%d)", os.path.join(save_dir, name), k)
    return removed
